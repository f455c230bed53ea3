// Go 1.19 net/http ServeMux upstream for tests/route_agreement.rs: counts runs per
// Idempotency-Key. Usage: servemux PORT. GET /__count?key=K answers "N handler...".
package main

import (
	"fmt"
	"net/http"
	"os"
	"strings"
	"sync"
)

var (
	mu   sync.Mutex
	runs = map[string][]string{}
)

func run(w http.ResponseWriter, r *http.Request, handler string) {
	key := r.Header.Get("Idempotency-Key")
	mu.Lock()
	runs[key] = append(runs[key], handler)
	mu.Unlock()
	w.WriteHeader(201)
	fmt.Fprintf(w, "ran %s\n", handler)
}

func main() {
	mux := http.NewServeMux()
	mux.HandleFunc("/v1/payments", func(w http.ResponseWriter, r *http.Request) {
		if r.Method != "POST" {
			http.Error(w, "method", 405)
			return
		}
		run(w, r, "payments")
	})
	// Go 1.19 has no {id} patterns: the subtree, split as an app would split it.
	mux.HandleFunc("/v1/orders/", func(w http.ResponseWriter, r *http.Request) {
		rest := strings.Split(strings.TrimPrefix(r.URL.Path, "/v1/orders/"), "/")
		switch {
		case len(rest) == 2 && rest[0] != "" && rest[1] == "pay" && r.Method == "POST":
			run(w, r, "pay")
		case len(rest) == 1 && rest[0] != "" && r.Method == "PATCH":
			run(w, r, "order")
		default:
			http.NotFound(w, r)
		}
	})
	mux.HandleFunc("/__count", func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		got := runs[r.URL.Query().Get("key")]
		mu.Unlock()
		fmt.Fprintf(w, "%d %s", len(got), strings.Join(got, " "))
	})
	if err := http.ListenAndServe("127.0.0.1:"+os.Args[1], mux); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
