"""Where mergekit-darts meets other tools: mergekit's run_merge and mergekit-multi, the model card, the recorded recipe, upstream work-arounds."""
