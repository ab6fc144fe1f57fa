"""The HTTP routes: native (/generate, health, readiness, metrics) and OpenAI-compatible (/v1/...)."""
