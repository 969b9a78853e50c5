// batch: several chat requests share one session (continuous batching); one
// of them is cancelled from another thread once it has produced a few
// tokens. Handles are owned by std::unique_ptr with library deleters.
//
//   batch MODEL_DIR [--threads N]
#include <nanoinfer.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace ni {

struct ModelDeleter {
    void operator()(ni_model *m) const noexcept { ni_model_free(m); }
};
struct SessionDeleter {
    void operator()(ni_session *s) const noexcept { ni_session_free(s); }
};
struct OutputDeleter {
    void operator()(ni_step_output *o) const noexcept { ni_step_output_free(o); }
};
struct StringDeleter {
    void operator()(char *s) const noexcept { ni_string_free(s); }
};
using ModelPtr = std::unique_ptr<ni_model, ModelDeleter>;
using SessionPtr = std::unique_ptr<ni_session, SessionDeleter>;
using OutputPtr = std::unique_ptr<ni_step_output, OutputDeleter>;
using StringPtr = std::unique_ptr<char, StringDeleter>;

struct Error : std::runtime_error {
    ni_status status;
    Error(const char *what, ni_status st)
        : std::runtime_error(std::string(what) + ": " + ni_status_name(st) + ": " + ni_last_error()),
          status(st) {}
};

inline void check(ni_status st, const char *what) {
    if (st != NI_OK) throw Error(what, st);
}

ModelPtr load_model(const char *dir, unsigned threads) {
    ni_model_params p;
    ni_model_params_init(&p);
    p.n_threads = threads;
    ni_model *m = nullptr;
    check(ni_model_load(dir, &p, &m), "ni_model_load");
    return ModelPtr(m);
}

std::string chat_prompt(ni_model *model, const std::string &user) {
    ni_chat_message msg{"user", user.c_str()};
    char *text = nullptr;
    size_t len = 0;
    check(ni_apply_chat_template(model, &msg, 1, true, &text, &len), "ni_apply_chat_template");
    StringPtr owned(text);
    return std::string(owned.get(), len);
}

}  // namespace ni

struct Result {
    std::string prompt, text;
    size_t tokens = 0;
    ni_finish_reason finish = NI_FINISH_NONE;
};

static const char *finish_name(ni_finish_reason r) {
    switch (r) {
    case NI_FINISH_EOS: return "eos";
    case NI_FINISH_LENGTH: return "length";
    case NI_FINISH_CANCELLED: return "cancelled";
    case NI_FINISH_STOP_STRING: return "stop string";
    case NI_FINISH_STOP_TOKEN: return "stop token";
    case NI_FINISH_ERROR: return "error";
    default: return "running";
    }
}

int main(int argc, char **argv) try {
    const char *dir = nullptr;
    unsigned threads = 0;
    for (int i = 1; i < argc; i++) {
        if (std::strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = static_cast<unsigned>(std::strtoul(argv[++i], nullptr, 10));
        } else {
            dir = argv[i];
        }
    }
    if (!dir) {
        std::fprintf(stderr, "usage: %s MODEL_DIR [--threads N]\n", argv[0]);
        return 2;
    }

    ni::ModelPtr model = ni::load_model(dir, threads);
    ni_session_params sp;
    ni_session_params_init(&sp);
    sp.kv_capacity_tokens = 4096;
    ni_session *raw_session = nullptr;
    ni::check(ni_session_create(model.get(), &sp, &raw_session), "ni_session_create");
    ni::SessionPtr session(raw_session);

    const std::vector<std::string> questions = {
        "Name three primary colors.",
        "Write a long story about a dragon who learns to cook.",  // cancelled
        "What is 2 + 2?",
        "Give one tip for writing clean code.",
    };
    const size_t victim_index = 1;
    std::map<uint64_t, Result> results;
    uint64_t victim = 0;
    for (size_t i = 0; i < questions.size(); i++) {
        std::string prompt = ni::chat_prompt(model.get(), questions[i]);
        ni_request_params req;
        ni_request_params_init(&req);
        req.prompt_text = prompt.data();
        req.prompt_text_len = prompt.size();
        req.max_tokens = i == victim_index ? 400 : 40;
        req.ignore_eos = i == victim_index;  // make sure it is still running when cancelled
        uint64_t id = 0;
        ni::check(ni_session_add_request(session.get(), &req, &id), "ni_session_add_request");
        results[id].prompt = questions[i];
        if (i == victim_index) victim = id;
    }

    ni_step_output *raw_out = nullptr;
    ni::check(ni_step_output_create(&raw_out), "ni_step_output_create");
    ni::OutputPtr out(raw_out);
    bool cancel_sent = false;
    while (ni_session_has_work(session.get())) {
        ni::check(ni_session_step(session.get(), out.get()), "ni_session_step");
        const ni_event *events = ni_step_output_events(out.get());
        for (size_t i = 0; i < ni_step_output_count(out.get()); i++) {
            const ni_event &ev = events[i];
            Result &r = results.at(ev.request_id);
            r.text.append(ev.text, ev.text_len);
            r.tokens += ev.n_tokens;
            if (ev.finish_reason != NI_FINISH_NONE) r.finish = ev.finish_reason;
        }
        // Cancellation may come from any thread; it waits for a running step.
        if (!cancel_sent && results[victim].tokens >= 5) {
            // ni_last_error() is per thread: read it on the thread that failed.
            std::string cancel_error;
            std::thread canceller([&] {
                ni_status st = ni_session_cancel(session.get(), victim);
                if (st != NI_OK) cancel_error = std::string(ni_status_name(st)) + ": " + ni_last_error();
            });
            canceller.join();
            if (!cancel_error.empty()) throw std::runtime_error("ni_session_cancel: " + cancel_error);
            cancel_sent = true;
        }
    }

    ni_session_stats stats{};
    stats.struct_size = sizeof stats;
    ni::check(ni_session_get_stats(session.get(), &stats), "ni_session_get_stats");

    bool ok = true;
    for (const auto &[id, r] : results) {
        std::printf("[%llu] %s\n  -> (%zu tokens, %s) %s\n\n", static_cast<unsigned long long>(id), r.prompt.c_str(),
                    r.tokens, finish_name(r.finish), r.text.c_str());
        bool expect_cancel = id == victim;
        if (expect_cancel != (r.finish == NI_FINISH_CANCELLED) || r.finish == NI_FINISH_ERROR || r.tokens == 0) ok = false;
    }
    std::printf("steps %llu, prompt tokens %llu, decoded %llu, KV in use %llu of %llu tokens\n",
                static_cast<unsigned long long>(stats.steps), static_cast<unsigned long long>(stats.prefill_tokens),
                static_cast<unsigned long long>(stats.decode_tokens), static_cast<unsigned long long>(stats.kv_used_tokens),
                static_cast<unsigned long long>(stats.kv_capacity_tokens));
    if (!ok || stats.kv_used_tokens != 0) {
        std::fprintf(stderr, "batch: unexpected results\n");
        return 1;
    }
    return 0;
} catch (const std::exception &e) {
    std::fprintf(stderr, "batch: %s\n", e.what());
    return 1;
}
