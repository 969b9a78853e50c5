"""`nanoinfer serve` driven by the official OpenAI Python client, and by raw
HTTP for the error cases. Greedy outputs must equal `nanoinfer generate`'s
for the same prompt, since both run the same engine on the same tokens.

Run by scripts/test_server.sh (python3 -m unittest server/tests/test_openai.py).
"""

import concurrent.futures
import json
import subprocess
import time
import unittest

import httpx
import openai

from harness import CLI, MODEL, Server, metrics, wait_until

QUESTION = "What is the capital of France?"
STORY = "Once upon a time"


def generate_cli(prompt, max_tokens, chat):
    args = [CLI, "generate", "--model", MODEL, "--threads", "2", "--prompt", prompt,
            "--max-tokens", str(max_tokens), "--json"]
    if chat:
        args.append("--chat")
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


class ServerTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.server = Server("--max-seqs", "16").__enter__()
        cls.base = cls.server.base
        cls.client = openai.OpenAI(base_url=cls.base + "/v1", api_key="unused", max_retries=0)
        cls.http = httpx.Client(timeout=120)
        cls.model = cls.client.models.list().data[0].id

    @classmethod
    def tearDownClass(cls):
        cls.http.close()
        cls.server.__exit__(None, None, None)

    def post(self, path, body, **kw):
        return self.http.post(self.base + path, json=body, **kw)

    def chat(self, content=QUESTION, **kw):
        return self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": content}], **kw)

    # --- what a client sees ------------------------------------------------

    def test_models_lists_the_served_model(self):
        models = self.client.models.list().data
        self.assertEqual([m.id for m in models], ["SmolLM2-135M-Instruct"])

    def test_chat_greedy_equals_cli_generate(self):
        cli = generate_cli(QUESTION, 24, chat=True)
        r = self.chat(temperature=0, max_tokens=24)
        self.assertEqual(r.choices[0].message.content, cli["text"])
        self.assertEqual(r.choices[0].message.role, "assistant")
        self.assertEqual(r.usage.prompt_tokens, len(cli["prompt_ids"]))
        self.assertEqual(r.usage.completion_tokens, len(cli["output_ids"]))
        self.assertEqual(r.usage.total_tokens, r.usage.prompt_tokens + r.usage.completion_tokens)
        self.assertEqual(r.choices[0].finish_reason, cli["finish_reason"])
        self.assertIn("Paris", r.choices[0].message.content)

    def test_completion_greedy_equals_cli_generate(self):
        cli = generate_cli(STORY, 20, chat=False)
        r = self.client.completions.create(model=self.model, prompt=STORY, temperature=0, max_tokens=20)
        self.assertEqual(r.choices[0].text, cli["text"])
        self.assertEqual(r.usage.prompt_tokens, len(cli["prompt_ids"]))
        self.assertEqual(r.usage.completion_tokens, 20)
        self.assertEqual(r.choices[0].finish_reason, "length")
        # The same prompt as token ids gives the same text.
        r2 = self.client.completions.create(model=self.model, prompt=cli["prompt_ids"], temperature=0,
                                            max_tokens=20)
        self.assertEqual(r2.choices[0].text, cli["text"])

    def test_streaming_equals_non_streaming(self):
        whole = self.chat(temperature=0, max_tokens=32)
        chunks = list(self.chat(temperature=0, max_tokens=32, stream=True,
                                stream_options={"include_usage": True}))
        self.assertEqual(chunks[0].choices[0].delta.role, "assistant")
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        self.assertEqual(text, whole.choices[0].message.content)
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        self.assertEqual(finishes, [whole.choices[0].finish_reason])
        self.assertEqual(chunks[-1].choices, [])
        self.assertEqual(chunks[-1].usage.completion_tokens, whole.usage.completion_tokens)
        self.assertEqual(chunks[-1].usage.prompt_tokens, whole.usage.prompt_tokens)
        self.assertTrue(all(c.usage is None for c in chunks[:-1]))
        # Completions stream too.
        whole = self.client.completions.create(model=self.model, prompt=STORY, temperature=0, max_tokens=16)
        streamed = "".join(c.choices[0].text for c in self.client.completions.create(
            model=self.model, prompt=STORY, temperature=0, max_tokens=16, stream=True))
        self.assertEqual(streamed, whole.choices[0].text)

    def test_seeded_sampling_is_reproducible(self):
        kw = dict(temperature=1.0, top_p=0.95, max_tokens=24, seed=1234)
        a = self.chat("Tell me a story.", n=3, **kw)
        b = self.chat("Tell me a story.", n=3, **kw)
        ta = [c.message.content for c in a.choices]
        self.assertEqual(ta, [c.message.content for c in b.choices])
        self.assertEqual([c.index for c in a.choices], [0, 1, 2])
        self.assertGreater(len(set(ta)), 1, "n choices with one seed must differ")
        self.assertGreaterEqual(a.usage.completion_tokens, 3)
        # A streamed seeded request gives the same first choice.
        streamed = "".join(c.choices[0].delta.content or "" for c in self.chat("Tell me a story.", stream=True,
                                                                               **kw) if c.choices)
        self.assertEqual(streamed, ta[0])

    def test_stop_string_ends_the_text_before_it(self):
        full = self.chat(temperature=0, max_tokens=24).choices[0].message.content
        stop = "Paris"
        self.assertIn(stop, full)
        r = self.chat(temperature=0, max_tokens=24, stop=[stop, "never-appears"])
        self.assertEqual(r.choices[0].message.content, full[: full.index(stop)])
        self.assertEqual(r.choices[0].finish_reason, "stop")

    def test_logprobs(self):
        r = self.chat(temperature=0, max_tokens=8, logprobs=True, top_logprobs=3)
        content = r.choices[0].logprobs.content
        self.assertEqual(len(content), r.usage.completion_tokens)
        # The entries are every generated token, the end-of-sequence token
        # included (it counts in usage too); the text leaves it out.
        joined = "".join(t.token for t in content)
        self.assertEqual(joined, r.choices[0].message.content + "<|im_end|>")
        for t in content:
            self.assertLessEqual(t.logprob, 0.0)
            self.assertEqual(len(t.top_logprobs), 3)
            lps = [x.logprob for x in t.top_logprobs]
            self.assertEqual(lps, sorted(lps, reverse=True))
            # Greedy: the chosen token is the most likely one.
            self.assertEqual(t.top_logprobs[0].token, t.token)
            self.assertAlmostEqual(t.top_logprobs[0].logprob, t.logprob, places=5)
            self.assertEqual(bytes(t.bytes), t.token.encode())
        # Without top_logprobs: the chosen token only.
        r = self.chat(temperature=0, max_tokens=4, logprobs=True)
        self.assertTrue(all(t.top_logprobs == [] for t in r.choices[0].logprobs.content))
        # Completions' legacy shape.
        r = self.client.completions.create(model=self.model, prompt=STORY, temperature=0, max_tokens=5,
                                           logprobs=2)
        lp = r.choices[0].logprobs
        self.assertEqual("".join(lp.tokens), r.choices[0].text)
        self.assertEqual(len(lp.token_logprobs), 5)
        self.assertEqual(lp.text_offset[0], 0)
        self.assertTrue(all(len(t) == 2 for t in lp.top_logprobs))

    def test_completion_prompts_and_echo(self):
        r = self.client.completions.create(model=self.model, prompt=[STORY, "The sky is"], n=2,
                                           temperature=0, max_tokens=6, echo=True)
        self.assertEqual([c.index for c in r.choices], [0, 1, 2, 3])
        self.assertTrue(r.choices[0].text.startswith(STORY))
        self.assertTrue(r.choices[2].text.startswith("The sky is"))
        self.assertEqual(r.choices[0].text, r.choices[1].text)  # greedy: both choices alike
        single = self.client.completions.create(model=self.model, prompt="The sky is", temperature=0,
                                                max_tokens=6)
        self.assertEqual(r.choices[2].text, "The sky is" + single.choices[0].text)
        self.assertEqual(r.usage.completion_tokens, 4 * 6)
        self.assertEqual(r.usage.prompt_tokens,
                         single.usage.prompt_tokens + len(generate_cli(STORY, 1, False)["prompt_ids"]))

    def test_penalties_bias_and_extras_are_applied(self):
        base = self.chat(temperature=0, max_tokens=12).choices[0].message.content
        # Banning the greedy first token changes the reply.
        ids = generate_cli(QUESTION, 1, chat=True)["output_ids"]
        banned = self.chat(temperature=0, max_tokens=12, logit_bias={str(ids[0]): -100}).choices[0]
        self.assertNotEqual(banned.message.content, base)
        # vLLM-style extras reach the sampler.
        r = self.chat(temperature=0, max_tokens=12, extra_body={"min_tokens": 12, "ignore_eos": True})
        self.assertEqual(r.usage.completion_tokens, 12)
        r = self.chat(temperature=0.8, max_tokens=12, seed=3, presence_penalty=1.5, frequency_penalty=1.0,
                      extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2})
        self.assertGreater(r.usage.completion_tokens, 0)
        # Opting out of speculation is accepted (this server does not
        # speculate: the reply is the plain greedy one).
        r = self.chat(temperature=0, max_tokens=12, extra_body={"speculative": False})
        self.assertEqual(r.choices[0].message.content, base)

    def test_structured_output(self):
        schema = {"type": "object", "properties": {
            "city": {"type": "string", "maxLength": 30},
            "population": {"type": "integer", "minimum": 0},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3}},
            "required": ["city", "population", "landmarks"], "additionalProperties": False}
        fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}}
        for kw in [dict(temperature=0), dict(temperature=1.0, seed=5)]:
            r = self.chat("Describe Paris as JSON.", response_format=fmt, max_tokens=200, **kw)
            self.assertEqual(r.choices[0].finish_reason, "stop")
            v = json.loads(r.choices[0].message.content)
            self.assertEqual(set(v), {"city", "population", "landmarks"})
            self.assertIsInstance(v["city"], str)
            self.assertIsInstance(v["population"], int)
            self.assertGreaterEqual(v["population"], 0)
            self.assertLessEqual(len(v["landmarks"]), 3)
        # Streamed, the pieces join into the same object.
        whole = self.chat("Describe Paris as JSON.", response_format=fmt, max_tokens=200, temperature=0)
        streamed = "".join(c.choices[0].delta.content or "" for c in self.chat(
            "Describe Paris as JSON.", response_format=fmt, max_tokens=200, temperature=0, stream=True)
            if c.choices)
        self.assertEqual(streamed, whole.choices[0].message.content)
        r = self.chat("Give the name and age of a person as a JSON object.",
                      response_format={"type": "json_object"}, max_tokens=200, temperature=0)
        # Any object: this small model tends to add keys until the limit, so
        # a complete object is parsed and a cut one must still be one's start.
        text = r.choices[0].message.content
        if r.choices[0].finish_reason == "stop":
            self.assertIsInstance(json.loads(text), dict)
        else:
            self.assertTrue(text.startswith("{"), text)
        r = self.chat("Give the name and age of a person.", temperature=0, max_tokens=100,
                      extra_body={"guided_json": {"type": "object", "properties": {
                          "name": {"type": "string"}, "age": {"type": "integer"}},
                          "required": ["name", "age"], "additionalProperties": False}})
        self.assertEqual(set(json.loads(r.choices[0].message.content)), {"name", "age"})
        r = self.chat("Is water wet?", extra_body={"guided_choice": ["yes", "no"]}, temperature=1.0, seed=1)
        self.assertIn(r.choices[0].message.content, ["yes", "no"])
        r = self.client.completions.create(model=self.model, prompt="My phone number is ", max_tokens=20,
                                           extra_body={"guided_regex": r"\d{3}-\d{4}"})
        self.assertRegex(r.choices[0].text, r"^\d{3}-\d{4}$")
        # Cut off inside the object: finish "length".
        r = self.chat("Describe Paris as JSON.", response_format=fmt, max_tokens=3, temperature=0)
        self.assertEqual(r.choices[0].finish_reason, "length")

    def test_prefix_cache_shows_in_usage(self):
        system = "You are a helpful assistant. " * 40
        msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}]
        self.client.chat.completions.create(model=self.model, messages=msgs, max_tokens=2, temperature=0)
        r = self.client.chat.completions.create(model=self.model, messages=msgs, max_tokens=2, temperature=0)
        self.assertGreater(r.usage.prompt_tokens_details.cached_tokens, 0)

    def test_concurrent_requests_give_their_solo_outputs(self):
        prompts = [f"Count from {i} to {i + 5}." for i in range(12)]
        solo = [self.chat(p, temperature=0, max_tokens=16).choices[0].message.content for p in prompts[:3]]
        with concurrent.futures.ThreadPoolExecutor(12) as pool:
            together = list(pool.map(lambda p: self.chat(p, temperature=0, max_tokens=16)
                                     .choices[0].message.content, prompts))
        self.assertEqual(together[:3], solo)

    # --- errors: OpenAI-shaped bodies naming the field ---------------------

    def assert_error(self, resp, status, param=None, code=None):
        self.assertEqual(resp.status_code, status, resp.text)
        err = resp.json()["error"]
        self.assertTrue(err["message"])
        self.assertIn("type", err)
        if param is not None:
            self.assertEqual(err["param"], param, err)
        if code is not None:
            self.assertEqual(err["code"], code, err)
        return err

    def test_bad_requests(self):
        msgs = [{"role": "user", "content": "hi"}]
        self.assert_error(self.http.post(self.base + "/v1/chat/completions", content=b"{bad json"), 400)
        self.assert_error(self.http.post(self.base + "/v1/chat/completions", content=b"[1,2]"), 400)
        self.assert_error(self.post("/v1/chat/completions", {"model": "gpt-9", "messages": msgs}), 404,
                          "model", "model_not_found")
        cases = [
            ({"messages": msgs, "temperature": "hot"}, "temperature"),
            ({"messages": msgs, "temperature": 3}, "temperature"),
            ({"messages": msgs, "top_p": 0}, "top_p"),
            ({"messages": msgs, "n": 0}, "n"),
            ({"messages": msgs, "n": 1000}, "n"),
            ({"messages": msgs, "max_tokens": 0}, "max_tokens"),
            ({"messages": msgs, "max_tokens": -1}, "max_tokens"),
            ({"messages": msgs, "presence_penalty": 9}, "presence_penalty"),
            ({"messages": msgs, "logit_bias": {"abc": 1}}, "logit_bias.abc"),
            ({"messages": msgs, "logit_bias": {"99999999": 1}}, "logit_bias.99999999"),
            ({"messages": msgs, "logit_bias": {"5": 500}}, "logit_bias.5"),
            ({"messages": msgs, "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
            ({"messages": msgs, "top_logprobs": 2}, "top_logprobs"),
            ({"messages": msgs, "stop": [""]}, "stop"),
            ({"messages": msgs, "stop": ["x"] * 40}, "stop"),
            ({"messages": msgs, "stream_options": {"include_usage": True}}, "stream_options"),
            ({"messages": []}, "messages"),
            ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content[0]"),
            ({"messages": "hello"}, "messages"),
            ({"messages": msgs, "response_format": {"type": "xml"}}, "response_format.type"),
            ({"messages": msgs, "response_format": {"type": "json_schema"}}, "response_format.json_schema.schema"),
            ({"messages": msgs, "response_format": {"type": "json_schema", "json_schema": {
                "name": "x", "schema": {"type": "banana"}}}}, "response_format"),
            ({"messages": msgs, "guided_regex": "(unclosed"}, "guided_regex"),
            ({"messages": msgs, "guided_choice": []}, "guided_choice"),
            ({"messages": msgs, "guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
            ({"messages": msgs, "tools": [{"type": "function"}]}, "tools"),
            ({"messages": msgs, "min_tokens": 50, "max_tokens": 5}, "min_tokens"),
        ]
        for body, param in cases:
            with self.subTest(body=body):
                self.assert_error(self.post("/v1/chat/completions", body), 400, param)
        self.assert_error(self.post("/v1/completions", {"prompt": "x", "logprobs": 99}), 400, "logprobs")
        self.assert_error(self.post("/v1/completions", {}), 400, "prompt")
        self.assert_error(self.post("/v1/completions", {"prompt": [99999999]}), 400, "prompt[0]")
        self.assert_error(self.post("/v1/completions", {"prompt": []}), 400, "prompt")
        self.assert_error(self.post("/v1/completions", {"prompt": "x", "suffix": "y"}), 400, "suffix")
        self.assert_error(self.post("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}), 400, "echo")

    def test_prompt_too_long(self):
        long_text = "hello " * 9000
        self.assert_error(self.post("/v1/chat/completions", {"messages": [{"role": "user", "content": long_text}]}),
                          400, "messages", "context_length_exceeded")
        self.assert_error(self.post("/v1/completions", {"prompt": long_text}), 400, "prompt",
                          "context_length_exceeded")
        self.assert_error(self.post("/v1/completions", {"prompt": "hi", "max_tokens": 100000}), 400, "max_tokens",
                          "context_length_exceeded")

    def test_body_too_large_and_unknown_routes(self):
        big = b'{"prompt": "' + b"a" * (9 << 20) + b'"}'
        r = self.http.post(self.base + "/v1/completions", content=big)
        self.assertEqual(r.status_code, 413)
        self.assert_error(self.http.get(self.base + "/v1/nothing"), 404)
        self.assertEqual(self.http.get(self.base + "/v1/chat/completions").status_code, 405)

    def test_client_disconnect_cancels_at_once(self):
        before = metrics(self.http, self.base)
        aborted = 'nanoinfer_requests_finished_total{reason="abort"}'
        body = {"messages": [{"role": "user", "content": "Write a long essay."}], "max_tokens": 4000,
                "ignore_eos": True, "stream": True}
        with self.http.stream("POST", self.base + "/v1/chat/completions", json=body) as r:
            lines = r.iter_lines()
            got = 0
            for line in lines:
                if line.startswith("data:"):
                    got += 1
                if got >= 3:
                    break
        # The connection is closed: the request must end as aborted, and free its KV.
        self.assertTrue(wait_until(lambda: metrics(self.http, self.base).get(aborted, 0)
                                   > before.get(aborted, 0), 5))
        self.assertTrue(wait_until(lambda: metrics(self.http, self.base)["nanoinfer_requests_in_flight"] == 0, 5))
        m = metrics(self.http, self.base)
        self.assertLess(m["nanoinfer_generation_tokens_total"] - before["nanoinfer_generation_tokens_total"], 400)

    def test_metrics_and_health_and_page(self):
        self.chat(temperature=0, max_tokens=4)
        m = metrics(self.http, self.base)
        for name in ["nanoinfer_requests_waiting", "nanoinfer_requests_running", "nanoinfer_kv_cache_usage_ratio",
                     "nanoinfer_prefix_cache_hit_ratio", "nanoinfer_generation_tokens_total",
                     "nanoinfer_generation_tokens_per_second", "nanoinfer_time_to_first_token_seconds_count",
                     "nanoinfer_inter_token_latency_seconds_count", "nanoinfer_request_latency_seconds_count"]:
            self.assertIn(name, m)
        self.assertGreater(m["nanoinfer_time_to_first_token_seconds_count"], 0)
        self.assertGreater(m["nanoinfer_inter_token_latency_seconds_count"], 0)
        self.assertEqual(self.http.get(self.base + "/health").json(), {"status": "ok"})
        page = self.http.get(self.base + "/")
        self.assertEqual(page.status_code, 200)
        self.assertIn("text/html", page.headers["content-type"])
        self.assertIn("NanoInfer chat", page.text)


class ServerLimitsTest(unittest.TestCase):
    """Servers started with their own options."""

    def http(self, server):
        client = httpx.Client(timeout=60)
        self.addCleanup(client.close)
        return client

    def test_api_key(self):
        with Server("--api-key", "sekrit") as s:
            http = self.http(s)
            r = http.get(s.base + "/v1/models")
            self.assertEqual(r.status_code, 401)
            self.assertEqual(r.json()["error"]["code"], "invalid_api_key")
            bad = openai.OpenAI(base_url=s.base + "/v1", api_key="wrong", max_retries=0)
            with self.assertRaises(openai.AuthenticationError):
                bad.models.list()
            good = openai.OpenAI(base_url=s.base + "/v1", api_key="sekrit", max_retries=0)
            self.assertEqual(len(good.models.list().data), 1)
            # Health and metrics stay open for probes and scrapers.
            self.assertEqual(http.get(s.base + "/health").status_code, 200)

    def test_full_queue_is_503_with_retry_after(self):
        with Server("--max-seqs", "1", "--max-queue", "1") as s:
            body = {"prompt": "Once", "max_tokens": 200, "ignore_eos": True, "temperature": 0}

            def send(_):
                with httpx.Client(timeout=120) as http:
                    return http.post(s.base + "/v1/completions", json=body)

            with concurrent.futures.ThreadPoolExecutor(6) as pool:
                results = list(pool.map(send, range(6)))
            codes = sorted(r.status_code for r in results)
            self.assertIn(200, codes)
            self.assertIn(503, codes)
            self.assertEqual(set(codes), {200, 503})
            for r in results:
                if r.status_code == 503:
                    self.assertEqual(r.headers["retry-after"], "1")
                    self.assertEqual(r.json()["error"]["type"], "server_overloaded")
            m = metrics(self.http(s), s.base)
            self.assertGreater(m['nanoinfer_requests_rejected_total{reason="queue_full"}'], 0)
            self.assertEqual(m["nanoinfer_requests_in_flight"], 0)

    def test_request_timeout_cancels(self):
        with Server("--request-timeout", "0.5") as s:
            http = self.http(s)
            r = http.post(s.base + "/v1/completions",
                          json={"prompt": "Once", "max_tokens": 4000, "ignore_eos": True})
            self.assertEqual(r.status_code, 504)
            self.assertEqual(r.json()["error"]["type"], "timeout_error")
            self.assertTrue(wait_until(lambda: metrics(http, s.base)["nanoinfer_requests_in_flight"] == 0, 5))

    def test_sigterm_drains_then_cancels(self):
        s = Server("--shutdown-timeout", "1")
        s.start()
        try:
            http = self.http(s)
            body = {"prompt": "Once", "max_tokens": 4000, "ignore_eos": True, "stream": True}
            finish = []
            with http.stream("POST", s.base + "/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line.startswith("data:") and len(finish) == 0:
                        s.terminate()
                        finish.append("signalled")
                        started = time.monotonic()
                    if line.startswith("data: {"):
                        reason = json.loads(line[6:])["choices"][0]["finish_reason"]
                        if reason:
                            finish.append(reason)
            # The running request was cancelled after the grace period and
            # its stream ended with a finish reason.
            self.assertEqual(finish, ["signalled", "abort"])
            self.assertLess(time.monotonic() - started, 10)
            self.assertEqual(s.wait(30), 0)
        finally:
            s.stop()


if __name__ == "__main__":
    unittest.main()
