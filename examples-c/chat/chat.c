/*
 * chat: load a model, render a user message with its chat template, stream
 * the reply to stdout, clean up.
 *
 *   chat MODEL_DIR [PROMPT] [--max-tokens N] [--threads N]
 */
#include <nanoinfer.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void log_to_stderr(ni_log_level level, const char *message, void *user_data) {
    (void)user_data;
    if (level <= NI_LOG_WARN || getenv("NANOINFER_VERBOSE") != NULL) {
        fprintf(stderr, "[nanoinfer] %s\n", message);
    }
}

static int fail(const char *what, ni_status status) {
    fprintf(stderr, "chat: %s failed: %s: %s\n", what, ni_status_name(status), ni_last_error());
    return 1;
}

static const char *finish_name(ni_finish_reason r) {
    switch (r) {
    case NI_FINISH_EOS: return "eos";
    case NI_FINISH_STOP_TOKEN: return "stop token";
    case NI_FINISH_STOP_STRING: return "stop string";
    case NI_FINISH_LENGTH: return "length";
    case NI_FINISH_CANCELLED: return "cancelled";
    case NI_FINISH_ERROR: return "error";
    default: return "running";
    }
}

int main(int argc, char **argv) {
    const char *model_dir = NULL;
    const char *prompt = "What is the capital of France? Answer in one sentence.";
    unsigned max_tokens = 48, threads = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--max-tokens") == 0 && i + 1 < argc) {
            max_tokens = (unsigned)strtoul(argv[++i], NULL, 10);
        } else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = (unsigned)strtoul(argv[++i], NULL, 10);
        } else if (model_dir == NULL) {
            model_dir = argv[i];
        } else {
            prompt = argv[i];
        }
    }
    if (model_dir == NULL) {
        fprintf(stderr, "usage: %s MODEL_DIR [PROMPT] [--max-tokens N] [--threads N]\n", argv[0]);
        return 2;
    }
    if (ni_abi_version() != NI_ABI_VERSION) {
        fprintf(stderr, "chat: header ABI %d but library ABI %u\n", NI_ABI_VERSION, ni_abi_version());
        return 1;
    }
    fprintf(stderr, "nanoinfer %s\n", ni_version());
    ni_set_log_callback(log_to_stderr, NULL);

    int rc = 1;
    ni_status st;
    ni_model *model = NULL;
    ni_session *session = NULL;
    ni_step_output *out = NULL;

    ni_model_params mp;
    ni_model_params_init(&mp);
    mp.n_threads = threads;
    if ((st = ni_model_load(model_dir, &mp, &model)) != NI_OK) {
        rc = fail("ni_model_load", st);
        goto done;
    }

    ni_session_params sp;
    ni_session_params_init(&sp);
    sp.kv_capacity_tokens = 2048;
    if ((st = ni_session_create(model, &sp, &session)) != NI_OK) {
        rc = fail("ni_session_create", st);
        goto done;
    }
    /* The session keeps the model alive; the handle is no longer needed. */
    ni_model_free(model);
    model = NULL;

    ni_request_params req;
    ni_request_params_init(&req);
    /* The prompt as a conversation: rendered with the model's chat template,
     * with the user's text kept as text (typing "<|im_end|>" cannot end the
     * turn), unlike ni_apply_chat_template's text passed as prompt_text. */
    ni_chat_message msg = {.role = "user", .content = prompt};
    req.messages = &msg;
    req.n_messages = 1;
    req.max_tokens = max_tokens;
    uint64_t id = 0;
    if ((st = ni_session_add_request(session, &req, &id)) != NI_OK) {
        rc = fail("ni_session_add_request", st);
        goto done;
    }

    if ((st = ni_step_output_create(&out)) != NI_OK) {
        rc = fail("ni_step_output_create", st);
        goto done;
    }
    size_t generated = 0;
    ni_finish_reason finish = NI_FINISH_NONE;
    ni_usage usage = {0};
    while (ni_session_has_work(session)) {
        if ((st = ni_session_step(session, out)) != NI_OK) {
            rc = fail("ni_session_step", st);
            goto done;
        }
        const ni_event *events = ni_step_output_events(out);
        for (size_t i = 0; i < ni_step_output_count(out); i++) {
            const ni_event *ev = &events[i];
            fwrite(ev->text, 1, ev->text_len, stdout);
            fflush(stdout);
            generated += ev->n_tokens;
            if (ev->finish_reason != NI_FINISH_NONE) {
                finish = ev->finish_reason;
                usage = *ev->usage; /* set on the terminal event */
                if (ev->finish_reason == NI_FINISH_ERROR) {
                    fprintf(stderr, "\nchat: generation failed: %s\n", ev->error_message);
                }
            }
        }
    }
    printf("\n");

    ni_session_stats stats = {.struct_size = sizeof stats};
    if ((st = ni_session_get_stats(session, &stats)) != NI_OK) {
        rc = fail("ni_session_get_stats", st);
        goto done;
    }
    fprintf(stderr,
            "[request %llu: %llu prompt tokens (%llu cached), %zu tokens, finish: %s; "
            "first token %.0f ms, total %.0f ms; %llu steps]\n",
            (unsigned long long)id, (unsigned long long)usage.prompt_tokens,
            (unsigned long long)usage.cached_prompt_tokens, generated, finish_name(finish),
            usage.time_to_first_token_ns / 1e6, usage.total_time_ns / 1e6, (unsigned long long)stats.steps);
    rc = (finish == NI_FINISH_ERROR || generated == 0) ? 1 : 0;

done:
    ni_step_output_free(out);
    ni_session_free(session);
    ni_model_free(model);
    ni_set_log_callback(NULL, NULL);
    return rc;
}
