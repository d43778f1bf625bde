"""Where a family's artifacts come from: files inside installed packages, read without importing
them (trl's import pulls accelerate and datasets; the vocabulary packages need only their data).

A missing package raises :class:`ImportError` naming the ``families`` extra.
"""

from __future__ import annotations

import base64
import importlib.metadata
import importlib.util
import struct
from pathlib import Path

from pipeline.families._catalog import Family

EXTRA = "families"
TEMPLATE_PACKAGE = ("trl", "trl")  # (import name, distribution)


def package_dir(module: str, distribution: str) -> Path:
    """The folder of an installed package, found without executing it.

    Raises:
        ImportError: not installed; the message names the extra that installs it.
    """
    spec = importlib.util.find_spec(module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ImportError(
            f"model families need the package {distribution!r}, which is not installed: "
            f"pip install 'rollout-pipeline[{EXTRA}]' (or pip install {distribution})",
            name=module)
    return Path(locations[0])


def package_version(distribution: str) -> str:
    """The installed version of ``distribution`` ("" when its metadata is missing)."""
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return ""


def template_path(family: Family, *, training: bool = False) -> Path:
    """The file of the family's chat template in trl (``training``: the prefix-preserving
    variant).

    Raises:
        ValueError: ``training`` and trl has no training variant for the family.
        ImportError: trl is not installed.
    """
    name = family.training_template_file if training else family.template_file
    if name is None:
        raise ValueError(f"trl ships no training chat template for {family.name}")
    path = package_dir(*TEMPLATE_PACKAGE) / "chat_templates" / name
    if not path.is_file():
        raise ImportError(f"the installed trl ({package_version('trl')}) has no "
                          f"chat_templates/{name}; the {EXTRA!r} extra pins the trl it needs",
                          name="trl")
    return path


def read_template(family: Family, *, training: bool = False) -> str:
    """The family's chat template text, as trl ships it."""
    return template_path(family, training=training).read_text(encoding="utf-8")


def vocab_path(family: Family) -> Path:
    """The family's vocabulary file inside its package."""
    path = package_dir(family.vocab_module, family.vocab_package) / family.vocab_file
    if not path.is_file():
        raise ImportError(f"{family.vocab_package} {package_version(family.vocab_package)} has "
                          f"no {family.vocab_file}", name=family.vocab_module)
    return path


def read_tiktoken_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken BPE file (``base64-token rank`` per line) as token bytes -> rank."""
    ranks: dict[bytes, int] = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def read_quicktok_ranks(path: Path) -> dict[bytes, int]:
    """quicktok's binary vocabulary: a little-endian u32 count, then per token a u16 length,
    the token's bytes and a u32 rank (the layout quicktok's importer writes)."""
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    offset = 4
    ranks: dict[bytes, int] = {}
    for _ in range(count):
        (length,) = struct.unpack_from("<H", data, offset)
        offset += 2
        token = data[offset:offset + length]
        offset += length
        (rank,) = struct.unpack_from("<I", data, offset)
        offset += 4
        ranks[token] = rank
    if offset != len(data):
        raise ValueError(f"{path}: {len(data) - offset} bytes left after {count} tokens")
    return ranks


def read_quicktok_specials(path: Path) -> list[tuple[int, str]]:
    """quicktok's special-token table: a u32 count, then per token a u32 id, a u16 length and
    the UTF-8 text."""
    data = path.read_bytes()
    (count,) = struct.unpack_from("<I", data, 0)
    offset = 4
    out = []
    for _ in range(count):
        token_id, length = struct.unpack_from("<IH", data, offset)
        offset += 6
        out.append((token_id, data[offset:offset + length].decode("utf-8")))
        offset += length
    return out


def load_ranks(family: Family) -> dict[bytes, int]:
    """The family's BPE ranks (token bytes -> id) from its package's file."""
    path = vocab_path(family)
    if family.vocab_format == "tiktoken":
        ranks = read_tiktoken_ranks(path)
    elif family.vocab_format == "quicktok":
        ranks = read_quicktok_ranks(path)
    else:
        raise ValueError(f"{family.name}: {family.vocab_format} files hold a whole tokenizer")
    if len(ranks) != family.base_vocab_size or max(ranks.values()) != len(ranks) - 1:
        raise ValueError(f"{path}: {len(ranks)} ranks, expected {family.base_vocab_size} "
                         "numbered from 0")
    return ranks


def source_versions(family: Family) -> dict[str, str]:
    """The versions of the packages a family's artifacts come from (part of a build's key: an
    upgrade rebuilds)."""
    names = {TEMPLATE_PACKAGE[1], family.vocab_package, "transformers", "tokenizers"}
    return {name: package_version(name) for name in sorted(names)}
