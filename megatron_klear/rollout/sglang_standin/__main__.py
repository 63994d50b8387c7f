"""``python -m megatron_klear.rollout.sglang_standin``: the embedded engine behind the SGLang stand-in."""

from megatron_klear.rollout.sglang_standin.launcher import main

raise SystemExit(main())
