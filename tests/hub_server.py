"""A loopback stand-in for the Hugging Face Hub's HTTP API: just the calls `upload_folder`
makes (create repo, branch, preupload, commit), recording what was committed."""

from __future__ import annotations

import base64
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeHub:
    def __init__(self, token: str | None = None):
        self.token = token                 # when set, requests without it get 401
        self.commits: list[dict] = []
        self.repos: dict[str, dict] = {}
        self.branches: list[tuple[str, str]] = []
        self.requests: list[tuple[str, str]] = []
        self.seen_auth: list[str] = []
        self.validated: list[str] = []
        self.lfs_objects: dict[str, bytes] = {}
        self.lfs_threshold = 1 << 20
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _body(self) -> bytes:
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _send(self, status: int, payload) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _authorized(self) -> bool:
                auth = self.headers.get("Authorization", "")
                hub.seen_auth.append(auth)
                return hub.token is None or auth == f"Bearer {hub.token}"

            def do_PUT(self):
                body = self._body()
                hub.requests.append(("PUT", self.path))
                if self.path.startswith("/lfs-upload/"):
                    hub.lfs_objects[self.path.rsplit("/", 1)[1]] = body
                    self._send(200, {})
                else:
                    self._send(404, {"error": "not found"})

            def do_GET(self):
                hub.requests.append(("GET", self.path))
                self._send(404, {"error": "not found"})

            def do_POST(self):
                body = self._body()
                hub.requests.append(("POST", self.path))
                if not self._authorized():
                    self._send(401, {"error": "Invalid credentials"})
                    return
                parts = self.path.split("?")[0].strip("/").split("/")
                if parts[:3] == ["api", "repos", "create"]:
                    req = json.loads(body)
                    repo = f"{req.get('organization') or 'user'}/{req['name']}"
                    hub.repos[repo] = req
                    self._send(200, {"url": f"http://{self.headers['Host']}/{repo}", "name": repo})
                elif parts[:2] == ["api", "validate-yaml"]:
                    req = json.loads(body)
                    hub.validated.append(req.get("content", ""))
                    self._send(200, {"errors": [], "warnings": []})
                elif len(parts) >= 5 and parts[0] == "api" and parts[4] == "preupload":
                    req = json.loads(body)
                    # like the Hub: big files go through git-LFS, small ones inline in the commit
                    self._send(200, {"files": [{"path": f["path"], "shouldIgnore": False, "oid": None,
                                                "uploadMode": "lfs" if f.get("size", 0) > hub.lfs_threshold
                                                else "regular"} for f in req.get("files", [])]})
                elif self.path.split("?")[0].endswith(".git/info/lfs/objects/batch"):
                    req = json.loads(body)
                    base = f"http://{self.headers['Host']}/lfs-upload"
                    self._send(200, {"transfer": "basic", "objects": [
                        {"oid": o["oid"], "size": o["size"], "authenticated": True,
                         "actions": {"upload": {"href": f"{base}/{o['oid']}", "expires_in": 3600}}}
                        for o in req["objects"]]})
                elif len(parts) >= 5 and parts[0] == "api" and parts[4] == "commit":
                    lines = [json.loads(line) for line in body.decode().splitlines() if line.strip()]
                    header = next(line["value"] for line in lines if line["key"] == "header")
                    files = {}
                    for line in lines:
                        if line["key"] == "file":
                            files[line["value"]["path"]] = base64.b64decode(line["value"]["content"])
                        elif line["key"] == "lfsFile":
                            files[line["value"]["path"]] = hub.lfs_objects[line["value"]["oid"]]
                    repo = "/".join(parts[2:4])
                    revision = "/".join(parts[5:]) or "main"
                    hub.commits.append({"repo": repo, "revision": revision, "summary": header.get("summary"),
                                        "files": files})
                    self._send(200, {"commitUrl": f"http://{self.headers['Host']}/{repo}/commit/abc123",
                                     "commitOid": "abc123" * 6 + "abcd", "pullRequestUrl": None})
                elif len(parts) >= 5 and parts[0] == "api" and parts[4] == "branch":
                    hub.branches.append(("/".join(parts[2:4]), "/".join(parts[5:])))
                    self._send(200, {})
                else:
                    self._send(404, {"error": f"unknown endpoint {self.path}"})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
