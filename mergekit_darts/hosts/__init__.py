"""Where mergekit-darts meets other tools: mergekit (``mergekit/``), the post-merge step every
entry point runs (``post_merge``), lm-eval as a ``select`` metric (``lm_eval_dev``), one-line
click errors, the export (``deploy/``) and vLLM (``vllm_plugin/``)."""
