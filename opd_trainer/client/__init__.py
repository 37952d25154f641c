"""The Python client of the job server: `OPDClient` (synchronous) and `AsyncOPDClient` (asyncio), which
answer with the API's own pydantic models (`wire/schemas.py`), and `agentic_rl.AgenticRL` (Bailian's
asynchronous submit-and-wait shape on top of `AsyncOPDClient`).

`operations.py` defines each API operation once (request, answer model, errors, retries, paging, the
event stream) and `local_files.py` what happens on the local disk (zipping uploads, a spec's local
files, unpacking a checkpoint); both clients only send and await.
"""

from opd_trainer.client.api_client import OPDClient
from opd_trainer.client.async_client import AsyncOPDClient
from opd_trainer.client.operations import OPDAPIError, StreamEnd

__all__ = ["AsyncOPDClient", "OPDAPIError", "OPDClient", "StreamEnd"]
