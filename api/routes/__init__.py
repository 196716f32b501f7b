"""The service's routes, one APIRouter per concern: placement (solve, evaluate), jobs, meta (presets, health,
metrics). `api.app.create_app` includes them."""
