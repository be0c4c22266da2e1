"""A session policy a router or an agent runtime embeds: lifecycle signals in, kvhint.v1 hints out.

    from kvhint_client import KvHintClient, continuation
    from kvhint_client.policy import ClientSink, SessionPolicy, ToolCallStarted, RequestSent, TemplateDeclared

    with KvHintClient("127.0.0.1:50151") as kv:
        policy = SessionPolicy()
        policy.configure(kv.capabilities())
        sink = ClientSink(kv)
        policy.observe(TemplateDeclared("sys", continuation("sys-prompt-v3")))
        policy.observe(ToolCallStarted("agent-7", tools=("run_tests",)))
        policy.flush(sink)               # after signals, and on a timer (a few times a second)
        policy.observe(RequestSent("agent-7"))

`SessionPolicy` (policy.py) decides, `PauseModel` (estimator.py) learns pause durations,
the sinks (sinks.py) send, and `OpenAITrafficAdapter` (openai_adapter.py) derives the
signals from chat-completions traffic for routers that see nothing else.
`policy.model.export()` / `SessionPolicy(pause_state=...)` carry learned pause
durations from one policy instance to the next (warm start).
"""

from .estimator import PAUSE_STATE_FORMAT, PAUSE_STATE_VERSION, LogNormalPrior, PauseModel
from .openai_adapter import (
    OpenAITrafficAdapter,
    default_session_class_of,
    default_session_of,
    engine_session_of,
    parse_sse_line,
    upstream_headers,
)
from .policy import PolicyConfig, SessionPolicy
from .signals import (
    ChildJoined,
    ChildSpawned,
    RequestCompleted,
    RequestSent,
    SessionEnded,
    Signal,
    TemplateDeclared,
    TemplateRetired,
    ToolCallFinished,
    ToolCallStarted,
)
from .sinks import AsyncClientSink, AsyncHintSink, ClientSink, FleetSink, HintRateLimit, HintSink, RecordingSink, TokenBucket

__all__ = [
    "PAUSE_STATE_FORMAT",
    "PAUSE_STATE_VERSION",
    "AsyncClientSink",
    "AsyncHintSink",
    "ChildJoined",
    "ChildSpawned",
    "ClientSink",
    "FleetSink",
    "HintRateLimit",
    "HintSink",
    "LogNormalPrior",
    "OpenAITrafficAdapter",
    "PauseModel",
    "PolicyConfig",
    "RecordingSink",
    "RequestCompleted",
    "RequestSent",
    "SessionEnded",
    "SessionPolicy",
    "Signal",
    "TemplateDeclared",
    "TemplateRetired",
    "TokenBucket",
    "ToolCallFinished",
    "ToolCallStarted",
    "default_session_class_of",
    "default_session_of",
    "engine_session_of",
    "parse_sse_line",
    "upstream_headers",
]
