"""The Python client of the job server: `api_client.OPDClient` (HTTP) and `agentic_rl.AgenticRL`
(Bailian's asynchronous submit-and-wait shape on top of it).
"""

from opd_trainer.client.api_client import OPDAPIError, OPDClient

__all__ = ["OPDAPIError", "OPDClient"]
