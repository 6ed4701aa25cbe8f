"""Putting the gateway together: settings (``settings.py``), the stores they name
(``stores.py``), the pools and model of ``tandem up`` (``stack.py``), and the FastAPI app whose
lifespan builds the typed services the routes receive (``app.py``)."""
