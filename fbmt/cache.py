"""`python -m fbmt.cache`: what the compile cache holds, how big it is, and clearing it.

    python -m fbmt.cache list            # each entry: its model, when it was saved, size, compile time, and
                                         # whether it holds Inductor's compiled regions (all, or not some)
    python -m fbmt.cache size
    python -m fbmt.cache clear
    python -m fbmt.cache list --dir PATH # another folder than $FBMT_CACHE_DIR / ~/.cache/fbmt/compile

What an entry is and when one is used: NOTE: [Compile cache] in fbmt/compiler/cache.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fbmt.compiler import compile_cache
from fbmt.compiler.ops import size


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m fbmt.cache", description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=("list", "size", "clear"))
    ap.add_argument("--dir", help="the cache folder (default: $FBMT_CACHE_DIR, else ~/.cache/fbmt/compile)")
    args = ap.parse_args(argv)
    root = Path(args.dir).expanduser() if args.dir else compile_cache.default_dir()
    if root is None:
        print("the compile cache is off (FBMT_CACHE_DIR=off)")
        return
    found = compile_cache.entries(root)
    if args.command == "list":
        for e in found:
            a = e.about
            print(
                f"{e.path.name[:12]}  {a.get('saved', '?'):19}  {size(e.size):>10}  "
                f"compiled in {a.get('compile_seconds', '?')}s  {a.get('nodes', '?')} nodes  {a.get('model', '?')}"
                f"{_inductor(e.path)}"
            )
        print(f"{len(found)} entries in {root}")
    elif args.command == "size":
        print(f"{size(sum(e.size for e in found))} in {len(found)} entries in {root}")
    else:
        print(f"cleared {compile_cache.clear(root)} entries from {root}")


def _inductor(entry: Path) -> str:
    """What an entry holds of Inductor's compiled regions, as `list` says it."""
    if not (entry / "inductor.bin").exists():
        return ""
    missing = compile_cache.artifacts_missing(entry)
    if missing is None:
        return "  with Inductor's regions"
    return "  with Inductor's regions" + (f" (not {missing} that were compiling)" if missing else ", all")


if __name__ == "__main__":
    main()
