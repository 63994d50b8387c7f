import sys

from megatron_klear.rl.loop import main

if __name__ == "__main__":
    sys.exit(main())
