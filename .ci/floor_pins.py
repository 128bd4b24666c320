"""Print the lowest versions the package declares for the dependencies CI tests at their floor, as pip pins.

Usage: ``python .ci/floor_pins.py`` prints e.g. ``lightning==2.5 jsonargparse[signatures]==4.51 torchmetrics==1.0``,
read from the ``>=`` bounds in ``pyproject.toml`` so that the floor CI runs is the one the metadata declares.
"""

import re
import sys
from pathlib import Path

FLOORED = ("lightning", "jsonargparse", "torchmetrics")


def main() -> int:
    text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text(encoding="utf-8")
    dependencies = re.search(r"^dependencies = \[(.*?)^\]", text, re.MULTILINE | re.DOTALL)
    if dependencies is None:
        print("pyproject.toml has no `dependencies` list", file=sys.stderr)
        return 1
    pins = []
    for name in FLOORED:
        found = re.search(rf'"({re.escape(name)}(?:\[[\w,]+\])?)>=([\w.]+)"', dependencies[1])
        if found is None:
            print(f"pyproject.toml declares no `>=` floor for {name}", file=sys.stderr)
            return 1
        pins.append(f"{found[1]}=={found[2]}")
    print(" ".join(pins))
    return 0


if __name__ == "__main__":
    sys.exit(main())
