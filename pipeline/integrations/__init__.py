"""Optional integrations with trainers; each subpackage imports its trainer, the core never does.

``pipeline.integrations.verl``: verl 0.9.1 (install: ``scripts/install_verl.sh``).
"""
