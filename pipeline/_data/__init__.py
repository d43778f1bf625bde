"""The data model: configuration, dataset rows, items and samples, and the helpers that
build and summarize them (``construct``, ``items``, ``stats``, ``plain``). No behaviour that
runs a sample lives here. Private: users import from :mod:`pipeline`."""
