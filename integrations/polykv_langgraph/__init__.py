"""LangGraph agents on PolyKV (``pip install polykv[langgraph]``).

* ``PolyKVChatModel``: a ``BaseChatModel`` (built on ``ChatOpenAI``) keyed on the graph's
  thread, attached to a pool, reporting the engine's signals, raising typed refusals;
* ``PoolTree`` and ``pool_tools``: the pool tree as the program knows it, and the pool API as
  tools for ``bind_tools`` / ``ToolNode``;
* ``CapacityGate``: a node admitting a new session only while the engine says it fits;
* ``CompactionNode``: compaction by re-forking the stable ancestor with a summary;
* ``PolyKVState``: graph state with ``pool_id`` and capacity readings (reducer ``latest``).

Layering: this package sits on ``polykv_client`` (and LangChain/LangGraph), never on the
engine server.
"""

from .chat_model import METADATA_KEY, PolyKVChatModel, polykv_signals, session_key
from .compaction import CompactionNode
from .gate import INTERRUPT, CapacityGate
from .state import PolyKVState, capacity_update, latest
from .tools import PoolTree, Prefix, pool_tools

__all__ = [
    "INTERRUPT",
    "METADATA_KEY",
    "CapacityGate",
    "CompactionNode",
    "PolyKVChatModel",
    "PolyKVState",
    "PoolTree",
    "Prefix",
    "capacity_update",
    "latest",
    "polykv_signals",
    "pool_tools",
    "session_key",
]
