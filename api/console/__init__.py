"""The web console's static pages, served by api/routes/console.py under /console."""
