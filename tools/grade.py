"""Grade math and code responses from JSONL with the Klear rewards (math-verify; sandboxed tests).

    python tools/grade.py --input IN.jsonl --output OUT.jsonl [--workers N] [--config reward.yaml]

Each input line is {"id", "task": "math", "response", "answer"} or {"id", "task": "code",
"response", "tests": {"inputs", "outputs", "fn_name"?}}; each output line repeats the id and adds
reward, passed, total, error (null or a reason). A malformed line (a code item whose tests do not
match included) is named on stderr as FILE:LINE and gets reward null, and the exit status is 2
when there are more of them than --max-bad-lines (default 0). See
megatron_klear/rewards/cli.py.
"""

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from megatron_klear.rewards.cli import grade_main

    sys.exit(grade_main())
