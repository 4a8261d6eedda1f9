"""llmgw: run open-weight LLMs on a GPU fleet behind one OpenAI-compatible endpoint."""

__version__ = "0.1.0"
