"""Reading the ZeRO-Offload sidecar yaml: one clear line for every way the file can be wrong.

The sidecar (``<accelerate config stem>_zoffload.yaml``) holds the on/off switch
(``zero_offload:``), the settings (``zoffload:``) and, from format 2 on, ``version:``. What is
refused here, each as one ValueError naming the file and who named it (``named_by``, e.g.
``HF_ZOFFLOAD_CONFIG``), before any setting is used:

- a path that is missing, a directory, or cannot be read (permissions, an I/O error);
- text that is not UTF-8 or not valid YAML, or is not a mapping;
- a key given twice: YAML loaders keep the last one without a word, which would silently
  drop the first value someone wrote;
- a ``version`` this code does not read (see `SIDECAR_VERSION`).
"""

from __future__ import annotations

import os

YAML_SECTION = "zoffload"
# The sidecar's format, not the package's version: bumped only when a key changes meaning
# or is removed, so that a file written for another format is refused by name instead of
# being read with the wrong meaning. Format 1 is the file without a `version:` key (every
# sidecar written so far, and what `save_yaml` still writes, so older releases keep reading
# new files); a file may also say `version: 1`. A later format writes `version: N`.
SIDECAR_VERSION = 1
TOP_LEVEL_KEYS = ("zero_offload", YAML_SECTION, "version")


def check_path(path: str, *, named_by: str) -> None:
    """A sidecar path that names a readable file, or one ValueError saying what it is."""
    hint = "(the ZeRO-Offload sidecar yaml; `hf-zoffload config` writes one)"
    if os.path.isdir(path):
        raise ValueError(f"{named_by}={path}: is a directory, not a file {hint}")
    if not os.path.isfile(path):
        raise ValueError(f"{named_by}={path}: no such file {hint}")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{named_by}={path}: cannot be read (permission denied) {hint}")


def _loader():
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        """SafeLoader that refuses a mapping key given twice."""

    def mapping(loader, node, deep=False):
        seen = {}
        for key_node, _ in node.value:
            key = loader.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} is given twice (lines {seen[key] + 1} and "
                    f"{key_node.start_mark.line + 1}); keep one", key_node.start_mark)
            seen[key] = key_node.start_mark.line
        return loader.construct_mapping(node, deep=deep)

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
    return UniqueKeyLoader


def load_sidecar(path: str, *, named_by: str = "config_file") -> dict:
    """The sidecar yaml as a mapping, its format checked (`SIDECAR_VERSION`); every problem
    is one line naming the file (module docstring), not a traceback."""
    import yaml

    check_path(path, named_by=named_by)
    try:
        with open(path, "rb") as fh:  # bytes: yaml reports a bad encoding with its position
            data = yaml.load(fh, Loader=_loader())  # noqa: S506 (a SafeLoader subclass)
    except OSError as err:  # e.g. permissions that os.access did not see, an I/O error
        raise ValueError(f"{named_by}={path}: cannot be read ({err.strerror or err})") from None
    except yaml.reader.ReaderError as err:  # bytes that are no text in any YAML encoding
        raise ValueError(f"{path}: not valid YAML: not {err.encoding or 'printable'} text "
                         f"({err.reason} at byte {err.position})") from None
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        what = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ValueError(f"{path}: not valid YAML{where}: {what}") from None
    data = {} if data is None else data
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping with a '{YAML_SECTION}:' section")
    version = data.get("version", SIDECAR_VERSION)
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"{path}: 'version' must be a whole number >= 1 (the sidecar format), "
                         f"got {version!r}")
    if version != SIDECAR_VERSION:
        raise ValueError(
            f"{path}: sidecar format version {version}, but this hf-zoffload reads format "
            f"{SIDECAR_VERSION}: it was written by another release. Install that release, or "
            "write the file again with `hf-zoffload config`")
    if "zero_offload" in data and not isinstance(data["zero_offload"], bool):
        raise ValueError(f"{path}: 'zero_offload' must be true or false, got "
                         f"{data['zero_offload']!r}")
    return data
