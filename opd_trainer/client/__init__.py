"""The Python client of the job server: `OPDClient` (synchronous, `api_client.py`) and `AsyncOPDClient`
(asyncio, `async_client.py`), which answer with the API's own pydantic models (`wire/schemas.py`), and
`agentic_rl` (Bailian's submission classes, `AgenticRL`, on top of `AsyncOPDClient`).

`operations.py` defines each API operation once (request, answer model, errors, retries, paging, the
event stream) and `local_files.py` what happens on the local disk (zipping uploads, a spec's local
files, unpacking a checkpoint); both clients only send and await. `webhooks.py` signs and verifies
webhook deliveries (Standard Webhooks), for the server and for receivers.
"""

from opd_trainer.client.api_client import OPDClient
from opd_trainer.client.async_client import AsyncOPDClient
from opd_trainer.client.operations import OPDAPIError, StreamEnd

__all__ = ["AsyncOPDClient", "OPDAPIError", "OPDClient", "StreamEnd"]
