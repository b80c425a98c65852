"""The asyncio side: the aiohttp app, routes, keys, errors, the admission gate, metrics."""
