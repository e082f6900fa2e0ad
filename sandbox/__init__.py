"""tide code sandbox: crun containers in a pre-created cgroup pool, served over HTTP.

Importing the package pulls in only the message types and the client; the runtime (root, crun) and the
service (FastAPI) are imported from their modules.
"""
from .client import SandboxClient, SandboxError
from .config import SandboxConfig
from .models import (
           BatchRequest,
           BatchResult,
           Health,
           Limits,
           RunRequest,
           RunResult,
           Status,
)

__all__ = ["SandboxClient", "SandboxError", "SandboxConfig", "Limits", "RunRequest", "RunResult", "Status",
           "BatchRequest", "BatchResult", "Health"]
