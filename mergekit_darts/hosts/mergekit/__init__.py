"""mergekit: the hook on its ``run_merge`` (stock ``mergekit-yaml``), ``mergekit-multi``, the
surgery block recorded in ``mergekit_config.yml``, upstream work-arounds."""
