"""A local stand-in for the W&B server, enough for wandb's own `wandb sync` to upload a run.

wandb 0.31's sync (wandb-core) asks the server, over GraphQL, whether the run exists
(`RunResumeStatus`), creates or updates it (`UpsertBucket`), asks where to upload files
(`CreateRunFiles`, then PUTs them), and streams history, summary, system metrics and console
lines to `/files/<entity>/<project>/<run>/file_stream` as `{"files": {name: {"offset": N,
"content": [json lines]}}}`. This server answers those (others get `{"data": {}}`) and keeps
what it received per run, so a test can check what reached "the server" through wandb's real
code path. A resumed run is told its history line count and tail, as the real server does, so
later uploads continue it. Uploaded files (media: tables, images) and the latest summary are kept. It is not W&B's server: it keeps every history line it is sent.
"""

from __future__ import annotations

import http.server
import json
import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FakeRun:
    """What the server holds for one run."""

    name: str
    project: str
    history: list[dict[str, Any]] = field(default_factory=list)
    upserts: int = 0
    uploads: list[str] = field(default_factory=list)
    files: dict[str, bytes] = field(default_factory=dict)      # uploaded file name -> content
    summary: dict[str, Any] = field(default_factory=dict)      # the latest wandb-summary.json
    complete: bool = False

    @property
    def steps(self) -> list[int]:
        return [int(row["_step"]) for row in self.history if "_step" in row]


ARTIFACT_OPS = ("CreateArtifact", "CreateArtifactFiles", "CreateArtifactManifest",
                "UpdateArtifactManifest", "CommitArtifact", "UseArtifact")


class FakeWandbServer:
    """Serves on 127.0.0.1 in a thread; ``url`` is the WANDB_BASE_URL to use."""

    ENTITY = "fake-entity"

    def __init__(self) -> None:
        self.runs: dict[str, FakeRun] = {}
        self.requests: list[str] = []
        self.artifacts: dict[str, dict[str, Any]] = {}      # id -> name, type, state, files
        self.lock = threading.Lock()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _json(self, data: Any) -> None:
                out = json.dumps(data).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def do_POST(self) -> None:  # noqa: N802
                body = self._body()
                with server.lock:
                    server.requests.append(f"POST {self.path}")
                    if self.path.startswith("/graphql"):
                        self._json(server.graphql(json.loads(body or b"{}")))
                    elif self.path.endswith("/file_stream"):
                        parts = self.path.strip("/").split("/")   # files/ENTITY/PROJECT/RUN/file_stream
                        server.file_stream(parts[2], parts[3], json.loads(body or b"{}"))
                        self._json({"exitcode": None, "limits": {}})
                    else:
                        self._json({})

            def do_PUT(self) -> None:  # noqa: N802
                body = self._body()
                with server.lock:
                    server.requests.append(f"PUT {self.path}")
                    _, run, name = (self.path.strip("/").split("/", 2) + ["", ""])[:3]
                    if run == "_artifacts":      # /upload/_artifacts/<artifact id>/<file name>
                        art, _, file = name.partition("/")
                        if art in server.artifacts:
                            server.artifacts[art]["files"][file] = body
                    elif run in server.runs:
                        server.runs[run].uploads.append(name)
                        server.runs[run].files[name] = body
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeWandbServer:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # --- what the server answers ---------------------------------------------------------
    def _bucket(self, run: FakeRun) -> dict[str, Any]:
        tail = [json.dumps(row) for row in run.history[-1:]]
        return {"id": f"bucket-{run.name}", "name": run.name, "displayName": run.name,
                "description": None, "config": "{}", "sweepName": None, "summaryMetrics": "{}",
                "logLineCount": 0, "historyLineCount": len(run.history), "eventsLineCount": 0,
                "historyTail": json.dumps(tail), "eventsTail": "[]", "tags": [], "notes": None,
                "wandbConfig": "{}",
                "project": {"id": "project-id", "name": run.project,
                            "entity": {"id": "entity-id", "name": self.ENTITY}}}

    def graphql(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("operationName") or ""
        v = request.get("variables") or {}
        if op == "RunResumeStatus":
            run = self.runs.get(v.get("name", ""))
            return {"data": {"model": {"id": "project-id", "name": v.get("project") or "uncategorized",
                                       "entity": {"id": "entity-id", "name": self.ENTITY},
                                       "bucket": self._bucket(run) if run else None}}}
        if op == "UpsertBucket":
            name = v.get("name") or v.get("id") or "run"
            run = self.runs.get(name)
            inserted = run is None
            if run is None:
                run = self.runs[name] = FakeRun(name, v.get("project") or "uncategorized")
            run.upserts += 1
            return {"data": {"upsertBucket": {"bucket": self._bucket(run), "inserted": inserted}}}
        if op == "CreateRunFiles":
            files = [{"name": f, "uploadUrl": f"{self.url}/upload/{v.get('run')}/{f}"}
                     for f in v.get("files", [])]
            return {"data": {"createRunFiles": {"runID": f"bucket-{v.get('run')}",
                                                "uploadHeaders": [], "files": files}}}
        if op in ARTIFACT_OPS:
            return {"data": self.artifact_op(op, v)}
        return {"data": {}}

    def artifact_op(self, op: str, v: dict[str, Any]) -> dict[str, Any]:
        """Enough of the artifact protocol for wandb-core to log a run's tables (``run_table``
        artifacts): create, file and manifest upload URLs, commit. Each artifact keeps its files."""
        if op == "CreateArtifact":
            art_id = f"artifact-{len(self.artifacts)}"
            given = v.get("input") or {}
            self.artifacts[art_id] = {"name": given.get("artifactCollectionName", ""),
                                      "type": given.get("artifactTypeName", ""), "state": "PENDING",
                                      "files": {}}
            return {"createArtifact": {"artifact": {"id": art_id, "state": "PENDING",
                                                    "artifactSequence": {"latestArtifact": None}}}}
        if op == "CreateArtifactFiles":
            nodes = [{"node": {"storagePath": f"{f['artifactID']}/{f['name']}",
                               "uploadUrl": f"{self.url}/upload/_artifacts/{f['artifactID']}/{f['name']}",
                               "uploadHeaders": [], "uploadMultipartUrls": None,
                               "artifact": {"id": f["artifactID"]}}}
                     for f in (v.get("input") or {}).get("artifactFiles", [])]
            return {"createArtifactFiles": {"files": {"edges": nodes}}}
        if op in ("CreateArtifactManifest", "UpdateArtifactManifest"):
            art_id = v.get("artifactID") or ""
            key = "createArtifactManifest" if op == "CreateArtifactManifest" else "updateArtifactManifest"
            return {key: {"artifactManifest": {"id": f"manifest-{art_id}", "file": {
                "id": f"manifest-file-{art_id}",
                "uploadUrl": f"{self.url}/upload/_artifacts/{art_id}/wandb_manifest.json",
                "uploadHeaders": []}}}}
        if op == "CommitArtifact":
            art = self.artifacts.get(v.get("artifactID") or "")
            if art is not None:
                art["state"] = "COMMITTED"
            return {"commitArtifact": {"artifact": {"id": v.get("artifactID"), "digest": "fake"}}}
        return {"useArtifact": {"artifact": {"id": (v.get("input") or {}).get("artifactID")}}}

    def file_stream(self, project: str, run_name: str, body: dict[str, Any]) -> None:
        run = self.runs.setdefault(run_name, FakeRun(run_name, project))
        for name, chunk in (body.get("files") or {}).items():
            if name == "wandb-history.jsonl":
                run.history.extend(json.loads(line) for line in chunk.get("content", []))
            elif name == "wandb-summary.json" and chunk.get("content"):
                run.summary = json.loads(chunk["content"][-1])
        if body.get("complete"):
            run.complete = True
