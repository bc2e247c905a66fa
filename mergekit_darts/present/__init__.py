"""How a run is shown to people: the model card of the merged folder and of an export (``card``),
the terminal summary (``summary``), the surgery report and its figures (``report``, ``plots``,
``document``)."""
