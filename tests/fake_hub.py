"""A tiny local stand-in for the Hugging Face Hub HTTP API, for upload tests.

It answers exactly the calls that ``HfApi.create_repo``, ``create_branch`` and
``upload_folder`` make (huggingface_hub 2.x, without Xet):

==========================================================  =================
request                                                     route name
==========================================================  =================
POST /api/repos/create                                      ``create_repo``
POST /api/{type}s/{ns}/{name}/branch/{branch}               ``create_branch``
POST /api/validate-yaml            (README.md metadata)     ``validate_yaml``
POST /api/{type}s/{ns}/{name}/preupload/{rev}               ``preupload``
POST /{ns}/{name}.git/info/lfs/objects/batch                ``lfs_batch``
PUT  /__lfs__/{oid}                (LFS "basic" upload)     ``lfs_upload``
POST /api/{type}s/{ns}/{name}/commit/{rev}  (NDJSON)        ``commit``
GET  /api/{type}s/{ns}/{name}[/revision/{rev}]              ``repo_info``
GET  /api/{type}s/{ns}/{name}/refs                          ``list_refs``
==========================================================  =================

The preupload answer puts every file in "regular" mode (content inlined,
base64, in the commit payload), so neither LFS nor Xet is needed; pass
``lfs_min_size=N`` to have files of N bytes or more go through the LFS batch
API instead ("basic" transfer, the upload URL points back at this server).

Every request is recorded (:attr:`FakeHub.requests`), with the route name it
matched or ``None`` for anything this server does not know: those get a 404
with a JSON error and are also listed in :attr:`FakeHub.unexpected`.

Usage::

    with FakeHub() as hub:
        env = {..., "HF_ENDPOINT": hub.url}
        ...
        assert hub.commits[0].files["config.json"] == b"..."

``fail={"create_repo": 401}`` makes a route answer with that HTTP status (and
a Hub-like JSON error) instead; ``token="hf_..."`` makes every API call
without ``Authorization: Bearer <token>`` answer 401.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

_REPO = r"(?P<repo>[^/]+/[^/]+)"
_TYPE = r"(?P<type>models|datasets|spaces)"
ROUTES: list[tuple[str, str, re.Pattern[str]]] = [
    ("POST", "create_repo", re.compile(r"/api/repos/create")),
    ("POST", "validate_yaml", re.compile(r"/api/validate-yaml")),
    ("POST", "create_branch", re.compile(rf"/api/{_TYPE}/{_REPO}/branch/(?P<rev>[^/]+)")),
    ("POST", "preupload", re.compile(rf"/api/{_TYPE}/{_REPO}/preupload/(?P<rev>[^/]+)")),
    ("POST", "commit", re.compile(rf"/api/{_TYPE}/{_REPO}/commit/(?P<rev>[^/]+)")),
    ("POST", "lfs_batch", re.compile(rf"/(?:(?P<type>datasets|spaces)/)?{_REPO}\.git/info/lfs/objects/batch")),
    ("PUT", "lfs_upload", re.compile(r"/__lfs__/(?P<oid>[0-9a-f]{64})")),
    ("GET", "list_refs", re.compile(rf"/api/{_TYPE}/{_REPO}/refs")),
    ("GET", "repo_info", re.compile(rf"/api/{_TYPE}/{_REPO}(?:/revision/(?P<rev>[^/]+))?")),
]


@dataclass
class Request:
    """One HTTP request as the fake Hub received it."""

    method: str
    path: str  # without the query string, still URL-quoted
    query: dict[str, list[str]]
    headers: dict[str, str]  # lower-case names
    body: bytes
    route: str | None = None  # the route name it matched, None when unknown
    status: int = 0  # what the fake Hub answered

    def json(self) -> Any:
        """The body parsed as JSON."""
        return json.loads(self.body)


@dataclass
class Commit:
    """A commit as decoded from the NDJSON payload of ``POST .../commit/{rev}``."""

    repo_id: str
    repo_type: str
    branch: str
    oid: str
    message: str
    description: str
    files: dict[str, bytes] = field(default_factory=dict, repr=False)  # path -> content, regular and LFS alike
    lfs_paths: list[str] = field(default_factory=list)  # which of ``files`` came through LFS
    deleted: list[str] = field(default_factory=list)
    parent_commit: str | None = None


@dataclass
class Repo:
    """A repository the fake Hub holds."""

    repo_id: str
    repo_type: str
    private: bool
    visibility: str | None
    branches: dict[str, str]  # name -> head commit oid
    files: dict[str, bytes] = field(default_factory=dict, repr=False)  # every file ever committed, any branch


class HubError(Exception):
    """Answer with this status, JSON error and X-Error-Code."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def _oid(*parts: str) -> str:
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()


class FakeHub:
    """The local fake Hub server: start with ``with FakeHub() as hub`` or ``hub.start()``; ``hub.url``."""

    def __init__(self, *, fail: dict[str, int] | None = None, token: str | None = None,
                 lfs_min_size: int | None = None, user: str = "user"):
        self.fail = dict(fail or {})
        self.token = token
        self.lfs_min_size = lfs_min_size
        self.user = user
        self.requests: list[Request] = []
        self.repos: dict[str, Repo] = {}
        self.commits: list[Commit] = []
        self.lfs_objects: dict[str, bytes] = {}  # sha256 hex -> content
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._url: str | None = None

    # ---- life cycle -------------------------------------------------------

    def start(self) -> FakeHub:
        """Listen on 127.0.0.1 (a free port) in a daemon thread."""
        hub = self

        class Handler(_Handler):
            fake_hub = hub

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        host, port = self._server.server_address[:2]
        self._url = f"http://{host}:{port}"
        # serve_forever notices shutdown() only between polls (every 0.5 s by default): stopping waits for one.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        name="fake-hub", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Shut the server down (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> FakeHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (what HF_ENDPOINT should be); still readable after :meth:`stop`."""
        assert self._url is not None, "FakeHub was never started"
        return self._url

    # ---- what tests look at ----------------------------------------------

    @property
    def unexpected(self) -> list[Request]:
        """Requests that matched no known route (answered 404)."""
        return [r for r in self.requests if r.route is None]

    def calls(self, route: str) -> list[Request]:
        """The recorded requests of one route name."""
        return [r for r in self.requests if r.route == route]

    @property
    def routes(self) -> list[str | None]:
        """The route name of every request, in order."""
        return [r.route for r in self.requests]

    # ---- request handling (called from server threads) -----------------

    def handle(self, req: Request) -> tuple[int, dict[str, str], bytes]:
        with self._lock:
            self.requests.append(req)
            try:
                match = None
                for method, name, pattern in ROUTES:
                    m = pattern.fullmatch(req.path)
                    if m and method == req.method:
                        req.route, match = name, m
                        break
                if match is None:
                    raise HubError(404, f"fake hub: no route for {req.method} {req.path}", "EndpointNotFound")
                if req.route in self.fail:
                    status = self.fail[req.route]
                    msg = {401: "Invalid username or password.", 403: "You don't have the rights to do this"}
                    raise HubError(status, msg.get(status, f"fake hub: {req.route} fails with {status}"))
                if self.token is not None and req.route != "lfs_upload":
                    if req.headers.get("authorization") != f"Bearer {self.token}":
                        raise HubError(401, "Invalid credentials in Authorization header")
                groups = {k: unquote(v) for k, v in match.groupdict().items() if v is not None}
                status, body = getattr(self, "_" + req.route)(req, **groups)
            except HubError as e:
                req.status = e.status
                headers = {"X-Error-Message": e.message}
                if e.code:
                    headers["X-Error-Code"] = e.code
                return e.status, headers, json.dumps({"error": e.message}).encode()
            req.status = status
            return status, {}, json.dumps(body).encode()

    def _repo(self, repo_id: str, type: str = "models") -> Repo:
        repo = self.repos.get(repo_id)
        if repo is None or repo.repo_type + "s" != type:
            raise HubError(404, "Repository not found", "RepoNotFound")
        return repo

    def _branch(self, repo: Repo, rev: str) -> str:
        if rev not in repo.branches:
            raise HubError(404, f"Invalid rev id: {rev}", "RevisionNotFound")
        return rev

    def _create_repo(self, req: Request) -> tuple[int, Any]:
        p = req.json()
        name, org = p["name"], p.get("organization") or self.user
        repo_id = f"{org}/{name}"
        repo_type = p.get("type") or "model"
        if repo_id in self.repos:
            raise HubError(409, "You already created this model repo")
        visibility = p.get("visibility")
        head = _oid(repo_id, "initial commit")
        self.repos[repo_id] = Repo(repo_id, repo_type, visibility == "private", visibility, {"main": head})
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        return 200, {"url": f"{self.url}/{prefix}{repo_id}", "name": repo_id, "id": _oid(repo_id)[:24]}

    def _create_branch(self, req: Request, type: str, repo: str, rev: str) -> tuple[int, Any]:
        r = self._repo(repo, type)
        if rev in r.branches:
            raise HubError(409, f"Reference refs/heads/{rev} already exists")
        start = (req.json() if req.body else {}).get("startingPoint") or "main"
        r.branches[rev] = r.branches.get(start, start)
        return 200, {}

    def _validate_yaml(self, req: Request) -> tuple[int, Any]:
        return 200, {"errors": [], "warnings": []}

    def _preupload(self, req: Request, type: str, repo: str, rev: str) -> tuple[int, Any]:
        self._branch(self._repo(repo, type), rev)
        files = []
        for f in req.json()["files"]:
            lfs = self.lfs_min_size is not None and f["size"] >= self.lfs_min_size
            files.append({"path": f["path"], "uploadMode": "lfs" if lfs else "regular", "shouldIgnore": False, "oid": None})
        return 200, {"files": files, "commitOid": self._repo(repo, type).branches[rev]}

    def _lfs_batch(self, req: Request, repo: str, type: str = "models") -> tuple[int, Any]:
        self._repo(repo, type)
        p = req.json()
        objects = []
        for o in p["objects"]:
            obj = {"oid": o["oid"], "size": o["size"], "authenticated": True}
            if o["oid"] not in self.lfs_objects:
                obj["actions"] = {"upload": {"href": f"{self.url}/__lfs__/{o['oid']}", "expires_in": 3600}}
            objects.append(obj)
        return 200, {"transfer": "basic", "objects": objects, "hash_algo": "sha256"}

    def _lfs_upload(self, req: Request, oid: str) -> tuple[int, Any]:
        if hashlib.sha256(req.body).hexdigest() != oid:
            raise HubError(400, "fake hub: LFS upload content does not match its sha256")
        self.lfs_objects[oid] = req.body
        return 200, {}

    def _commit(self, req: Request, type: str, repo: str, rev: str) -> tuple[int, Any]:
        r = self._repo(repo, type)
        self._branch(r, rev)
        lines = [json.loads(line) for line in req.body.splitlines() if line.strip()]
        if not lines or lines[0].get("key") != "header":
            raise HubError(400, "fake hub: the commit payload must start with a header line")
        header = lines[0]["value"]
        commit = Commit(repo, r.repo_type, rev, "", header.get("summary", ""), header.get("description", ""),
                        parent_commit=header.get("parentCommit"))
        for line in lines[1:]:
            key, value = line["key"], line["value"]
            if key == "file":
                if value.get("encoding") != "base64":
                    raise HubError(400, f"fake hub: unsupported encoding {value.get('encoding')!r}")
                commit.files[value["path"]] = base64.b64decode(value["content"])
            elif key == "lfsFile":
                data = self.lfs_objects.get(value["oid"])
                if data is None or len(data) != value["size"]:
                    raise HubError(400, f"fake hub: LFS object of {value['path']} was not uploaded")
                commit.files[value["path"]] = data
                commit.lfs_paths.append(value["path"])
            elif key in ("deletedFile", "deletedFolder"):
                commit.deleted.append(value["path"])
            else:
                raise HubError(400, f"fake hub: unsupported commit operation {key!r}")
        commit.oid = _oid(repo, rev, r.branches[rev], *sorted(commit.files))
        r.branches[rev] = commit.oid
        r.files.update(commit.files)
        self.commits.append(commit)
        prefix = "" if r.repo_type == "model" else f"{r.repo_type}s/"
        return 200, {"success": True, "commitOid": commit.oid, "commitUrl": f"{self.url}/{prefix}{repo}/commit/{commit.oid}",
                     "pullRequestUrl": None}

    def _repo_info(self, req: Request, type: str, repo: str, rev: str = "main") -> tuple[int, Any]:
        r = self._repo(repo, type)
        sha = r.branches.get(rev, rev)
        return 200, {"id": repo, "modelId": repo, "sha": sha, "private": r.private, "disabled": False,
                     "gated": False, "siblings": [{"rfilename": f} for f in sorted(r.files)]}

    def _list_refs(self, req: Request, type: str, repo: str) -> tuple[int, Any]:
        r = self._repo(repo, type)
        branches = [{"name": b, "ref": f"refs/heads/{b}", "targetCommit": oid} for b, oid in r.branches.items()]
        return 200, {"branches": branches, "converts": [], "tags": []}


class _Handler(BaseHTTPRequestHandler):
    fake_hub: FakeHub
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:  # quiet: tests read the records instead
        pass

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            out = bytearray()
            while True:
                size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if size == 0:
                    while self.rfile.readline().strip():  # trailers
                        pass
                    return bytes(out)
                out += self.rfile.read(size)
                self.rfile.readline()  # CRLF after each chunk
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def _serve(self) -> None:
        parts = urlsplit(self.path)
        req = Request(
            method=self.command, path=parts.path, query=parse_qs(parts.query),
            headers={k.lower(): v for k, v in self.headers.items()}, body=self._read_body(),
        )
        status, headers, body = self.fake_hub.handle(req)
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers.items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = do_PATCH = _serve
