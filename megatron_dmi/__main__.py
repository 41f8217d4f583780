"""``python -m megatron_dmi``: the fast DMI command line (see megatron_dmi/__init__.py)."""

import sys

from megatron_dmi import main

if __name__ == "__main__":
    sys.exit(main())
