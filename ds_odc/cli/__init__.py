"""The command lines behind ``python -m ds_odc``: the environment report (``report``) and the config check
(``check``)."""

__all__: list[str] = []  # nothing: each module is imported on its own
