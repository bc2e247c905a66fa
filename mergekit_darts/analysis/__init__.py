"""Looking at results: diagnostics report, plots, statistics, sweeps."""
