"""The OPD job server: a FastAPI app over files, jobs, keys and health; it never runs user code or models.

Launch: `opd serve --data-dir DIR` (see `opd_trainer/cli/serve.py`), or `uvicorn api.main:app` with
the `OPD_*` settings of `api/settings.py` in the environment.
"""
