"""Checks of where pixelrl will write, made before the work that produces what it writes.

No side effects: nothing is created. A path is writable when its nearest existing ancestor is a
directory this process may write into and no existing component of it is a file.
"""

from __future__ import annotations

import os
from pathlib import Path

from pixelrl.core.errors import ConfigError


def _nearest_existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def _refuse_dangling_link(path: Path, field: str) -> None:
    """A link on the way to `path` whose target is gone: making the folder (or file) would fail
    with FileExistsError, or write wherever the link points once that appears."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        if probe.is_symlink():
            raise ConfigError(field, str(path), f"`{probe}` is a link to `{os.readlink(probe)}`, which does not "
                              "exist: remove the link, or make its target first")
        probe = probe.parent


def check_output_dir(path: str | Path, field: str) -> Path:
    """`path` is, or can be created as, a writable directory."""
    path = Path(path).expanduser().absolute()
    _refuse_dangling_link(path, field)
    if path.exists() and not path.is_dir():
        raise ConfigError(field, str(path), "is a file, not a folder: point it at a folder (it is created if missing)")
    base = _nearest_existing(path)
    if not base.is_dir():
        raise ConfigError(field, str(path), f"`{base}` is a file, so no folder can be made under it: choose another place")
    if not os.access(base, os.W_OK | os.X_OK):
        raise ConfigError(field, str(path), f"`{base}` is not writable by this user: choose a writable place or fix "
                                            "its permissions")
    return path


def check_output_file(path: str | Path, field: str, suffixes: tuple[str, ...] | None = None) -> Path:
    """`path` can be written as a file (its folder can be made, it is not a folder), with one of
    `suffixes` when given."""
    path = Path(path).expanduser().absolute()
    _refuse_dangling_link(path, field)
    if path.is_dir():
        raise ConfigError(field, str(path), "is a folder: give a file name (e.g. "
                          f"{path / ('out' + (suffixes[0] if suffixes else ''))})")
    if suffixes is not None and path.suffix.lower() not in suffixes:
        shown = ", ".join(suffixes[:6]) + (f" (or another of {len(suffixes)} known)" if len(suffixes) > 6 else "")
        raise ConfigError(field, str(path), f"unknown file type `{path.suffix or '(none)'}`: end the name with {shown}")
    blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    if blocking is not None:  # named with the whole path given, not only the folder it blocks
        raise ConfigError(field, str(path), f"{blocking} is a file, so nothing can be written under it: give a path "
                          "in a folder")
    check_output_dir(path.parent, field)
    return path


def image_suffixes() -> tuple[str, ...]:
    """File endings PIL can write (the common ones first)."""
    from PIL import Image

    Image.init()
    saveable = {ext for ext, fmt in Image.registered_extensions().items() if fmt in Image.SAVE}
    common = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tiff")
    return (*common, *sorted(saveable - set(common)))


def check_no_links_out(folder: str | Path, field: str) -> None:
    """No symbolic link inside `folder` points outside it: a crafted checkpoint could otherwise
    make `export` copy any file this user can read (a key, a token) into what gets published."""
    root = Path(folder).resolve()
    for current, dirs, files in os.walk(root):  # os.walk does not descend into linked folders
        for name in dirs + files:
            entry = Path(current) / name
            if entry.is_symlink():
                target = entry.resolve()
                if target != root and root not in target.parents:
                    raise ConfigError(field, str(folder), f"`{entry.relative_to(root)}` is a link to `{target}`, "
                                                          "outside the checkpoint: refusing to follow it; copy the "
                                                          "real files into the checkpoint if it is yours")
