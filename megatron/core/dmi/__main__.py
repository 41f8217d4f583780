"""``python -m megatron.core.dmi``: the DMI command line (see megatron/core/dmi/cli/)."""

import sys

from megatron.core.dmi.cli import main

if __name__ == "__main__":
    sys.exit(main())
