"""HTTP routes, one router per resource; each handler only calls the service layer."""
