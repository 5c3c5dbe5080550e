"""The command lines behind ``python -m ds_odc``: the environment report (``report``) and the config check
(``check``)."""
