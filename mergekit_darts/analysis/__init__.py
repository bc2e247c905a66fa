"""Looking at results: the surgery report (report, plots, document), statistics (stats, comparison), ablation sweeps (sweep/)."""
