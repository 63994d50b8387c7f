import sys

from megatron_klear.sft.trainer import main

if __name__ == "__main__":
    sys.exit(main())
