// Command example chats with a model through the Go binding: it loads the
// model, sends the question as a chat request (the library renders the
// model's chat template), and streams the answer with its usage. Ctrl-C (or -timeout) cancels the request at once, also in
// the middle of a long prompt's prefill.
//
//	go run ./example -model ../../models/SmolLM2-135M-Instruct "What is the capital of France?"
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"time"

	"github.com/nanoinfer/nanoinfer/bindings/go/nanoinfer"
)

func main() {
	modelDir := flag.String("model", "models/SmolLM2-135M-Instruct", "HuggingFace model directory")
	maxTokens := flag.Int("max-tokens", 128, "most tokens to generate")
	threads := flag.Int("threads", 0, "CPU kernel threads (0 = all cores)")
	cuda := flag.Bool("cuda", false, "run on the first NVIDIA GPU")
	timeout := flag.Duration("timeout", 0, "cancel the request after this long (0 = never)")
	flag.Parse()
	question := strings.Join(flag.Args(), " ")
	if question == "" {
		question = "What is the capital of France?"
	}
	if err := run(*modelDir, question, *maxTokens, *threads, *cuda, *timeout); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}

func run(modelDir, question string, maxTokens, threads int, cuda bool, timeout time.Duration) error {
	opts := &nanoinfer.ModelOptions{Threads: threads}
	if cuda {
		opts.Device = nanoinfer.DeviceCUDA
	}
	m, err := nanoinfer.LoadModel(modelDir, opts)
	if err != nil {
		return err
	}
	defer m.Close()
	s, err := nanoinfer.NewSession(m, nil)
	if err != nil {
		return err
	}
	defer s.Close()

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	start := time.Now()
	tokens := 0
	// A chat request: the library renders the model's template and keeps
	// the question plain text (typed "<|im_end|>" cannot end the turn).
	req := nanoinfer.Request{
		Messages:  []nanoinfer.ChatMessage{{Role: "user", Content: question}},
		MaxTokens: maxTokens,
	}
	for ev, err := range s.Generate(ctx, req) {
		if err != nil {
			fmt.Println()
			return fmt.Errorf("stopped after %d tokens: %w", tokens, err)
		}
		fmt.Print(ev.Text)
		tokens += len(ev.Tokens)
		if u := ev.Usage; u != nil {
			fmt.Printf("\n[%s: %d prompt tokens (%d cached), %d generated, first token after %v, %.2f s in all]\n",
				ev.Finish, u.PromptTokens, u.CachedPromptTokens, u.GeneratedTokens,
				u.TimeToFirstToken.Round(time.Millisecond), time.Since(start).Seconds())
		}
	}
	return nil
}
