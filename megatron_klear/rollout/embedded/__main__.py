"""``python -m megatron_klear.rollout.embedded``: the embedded engine behind an SGLang-compatible server."""
from megatron_klear.rollout.sglang_standin import main

raise SystemExit(main())
