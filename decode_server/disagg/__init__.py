"""PD disaggregation: the prefill and decode roles that connect the engine to the `transfer` package.

`bootstrap_info` (what a request carries) is imported by the api process and stays free of torch; the roles
(`prefill_role`, `decode_role`) and their memory glue (`memory`, `layout`) run in the engine process.
See docs/pd.md.
"""
