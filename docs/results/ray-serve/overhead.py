"""Per-request cost of the path between client and engine: a route that does no decoding, and a one-token request."""
import json, statistics, sys, time, urllib.request
url, label = sys.argv[1], sys.argv[2]
def timed(request_factory, count):
    times = []
    for _ in range(count):
        started = time.perf_counter()
        with urllib.request.urlopen(request_factory(), timeout=60) as response:
            response.read()
        times.append(time.perf_counter() - started)
    return round(statistics.median(times) * 1000, 2), round(sorted(times)[int(0.99 * (len(times) - 1))] * 1000, 2)
models = timed(lambda: url + "/v1/models", 200)
body = json.dumps({"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0}).encode()
one = timed(lambda: urllib.request.Request(url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}), 40)
body16 = json.dumps({"model": "smollm2-135m", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0, "stream": True}).encode()
stream16 = timed(lambda: urllib.request.Request(url + "/v1/completions", data=body16, headers={"Content-Type": "application/json"}), 20)
print(json.dumps({"label": label, "models_p50_ms": models[0], "models_p99_ms": models[1], "one_token_p50_ms": one[0], "one_token_p99_ms": one[1], "stream16_p50_ms": stream16[0]}))
