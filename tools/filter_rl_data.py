"""Filter RL problems like the paper: code needs >= 16 tests and a reference pass@16 >= 0.5;
math prompts are kept when most reference samples pass (pass rate >= 0.5).

    python tools/filter_rl_data.py --input problems.jsonl --output kept.jsonl --dropped dropped.jsonl

See megatron_klear/rewards/filters.py for the line format and the options.
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_klear.rewards.filters import filter_main

    sys.exit(filter_main())
