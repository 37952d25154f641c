"""A stand-in backend for the tool-routing tools, so the agent can feed real tool results back."""

from __future__ import annotations

import json
from typing import Any

STATUSES = ("shipped", "pending", "delivered", "on hold")


def run_tool(name: str, arguments: dict[str, Any]) -> str:
    """Deterministic results keyed on the arguments; unknown tools answer with an error, like real APIs."""
    if name == "query_status":
        item = str(arguments.get("item_id", ""))
        return json.dumps({"item_id": item, "status": STATUSES[sum(map(ord, item)) % len(STATUSES)]})
    if name == "delete_item":
        return json.dumps({"item_id": arguments.get("item_id"), "deleted": True})
    if name == "cancel_order":
        return json.dumps({"order_id": arguments.get("order_id"), "cancelled": True})
    if name == "update_priority":
        return json.dumps({"item_id": arguments.get("item_id"), "priority": arguments.get("priority")})
    if name == "create_ticket":
        return json.dumps({"ticket_id": "T-1001", "title": arguments.get("title")})
    return json.dumps({"error": f"unknown tool {name}"})
