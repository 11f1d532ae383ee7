"""`specdp bench serve`'s load generator against a stand-in server: with several load-generating processes, a
stream that frees up takes the run's next request, whichever process it is in."""
import http.server
import json
import threading

from specdp_cli.bench_serve import run_bench
from helpers import ModelListing

N = 6


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.answered: list[str] = []          # prompts, in the order their answers went out
        self.lock = threading.Lock()
        self.others_done = threading.Event()   # every prompt but p0 answered


class _Handler(ModelListing):
    """Streams one token a completion; holds p0's answer until every other prompt has had its own."""
    protocol_version = "HTTP/1.1"

    def do_POST(self):
        prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
        srv = self.server
        if prompt == "p0":
            srv.others_done.wait(timeout=30)   # fixed shares: p0's process would hold p2 and p4 behind it
        chunk = {"choices": [{"index": 0, "text": "x", "finish_reason": "length"}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
        body = f"data: {json.dumps(chunk)}\n\ndata: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        self.wfile.flush()
        with srv.lock:
            srv.answered.append(prompt)
            if len(srv.answered) == N - 1 and "p0" not in srv.answered:
                srv.others_done.set()


def test_load_processes_claim_requests_as_their_streams_free_up(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(N)))
    srv = _Server()
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        res = run_bench(f"http://127.0.0.1:{srv.server_address[1]}", str(prompts), 2, N, 4, None, None, workers=2)
    finally:
        srv.shutdown()
    assert res["completed"] == N and res["failed"] == 0 and res["num_workers"] == 2
    # one process held p0 while the other's stream took p1 .. p5 in turn; p0's answer came last
    assert srv.answered[-1] == "p0" and sorted(srv.answered[:-1]) == [f"p{i}" for i in range(1, N)]
    assert res["duration_s"] < 25              # p0 was released by the others' answers, not by its timeout
