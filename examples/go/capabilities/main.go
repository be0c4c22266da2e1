// Command kvhint-capabilities dials a KvHint endpoint (plaintext gRPC), calls
// kvhint.v1.KvHintService/GetCapabilities with a deadline and prints what the
// engine advertises. It exits non-zero on any error.
//
// Build (offline, against Debian's Go packages):
//
//	tools/build_stubs.sh go
//
// Run:
//
//	build/bin/kvhint-capabilities -address 127.0.0.1:50151
package main

import (
	"context"
	"flag"
	"fmt"
	"io"
	"os"
	"strings"
	"time"

	kvhintv1 "github.com/kvhint/kvhint/gen/go/kvhint/v1"
	"google.golang.org/grpc"
)

func main() {
	address := flag.String("address", "127.0.0.1:50151", "KvHint endpoint, host:port (plaintext)")
	timeout := flag.Duration("timeout", 5*time.Second, "deadline for the GetCapabilities call, connecting included")
	flag.Parse()

	ctx, cancel := context.WithTimeout(context.Background(), *timeout)
	defer cancel()
	resp, err := getCapabilities(ctx, *address)
	if err != nil {
		fmt.Fprintf(os.Stderr, "kvhint-capabilities: %v\n", err)
		os.Exit(1)
	}
	describe(os.Stdout, resp)
}

// getCapabilities dials address and calls GetCapabilities within ctx.
func getCapabilities(ctx context.Context, address string, opts ...grpc.DialOption) (*kvhintv1.GetCapabilitiesResponse, error) {
	// grpc-go 1.33 (Debian bookworm) predates grpc/credentials/insecure;
	// WithInsecure is the plaintext option there. The dial is non-blocking:
	// a connection failure surfaces as the RPC's UNAVAILABLE error, with its
	// cause (for example "connection refused"), within the same deadline.
	opts = append([]grpc.DialOption{grpc.WithInsecure()}, opts...)
	conn, err := grpc.DialContext(ctx, address, opts...)
	if err != nil {
		return nil, fmt.Errorf("dial %s: %w", address, err)
	}
	defer conn.Close()

	resp, err := kvhintv1.NewKvHintServiceClient(conn).GetCapabilities(ctx, &kvhintv1.GetCapabilitiesRequest{})
	if err != nil {
		return nil, fmt.Errorf("GetCapabilities on %s: %w", address, err)
	}
	return resp, nil
}

// describe prints protocol_version, engine, block_size and the supported
// actions (with the selector kinds each accepts).
func describe(w io.Writer, resp *kvhintv1.GetCapabilitiesResponse) {
	fmt.Fprintf(w, "protocol_version: %s\n", resp.GetProtocolVersion())
	fmt.Fprintf(w, "engine: %s %s\n", resp.GetEngine(), resp.GetEngineVersion())
	fmt.Fprintf(w, "block_size: %d\n", resp.GetBlockSize())
	var supported []string
	for _, a := range resp.GetActions() {
		if !a.GetSupported() {
			continue
		}
		sels := make([]string, 0, len(a.GetSelectors()))
		for _, s := range a.GetSelectors() {
			sels = append(sels, strings.TrimPrefix(s.String(), "SELECTOR_KIND_"))
		}
		supported = append(supported, fmt.Sprintf("%s[%s]",
			strings.TrimPrefix(a.GetAction().String(), "ACTION_"), strings.Join(sels, ",")))
	}
	if len(supported) == 0 {
		supported = []string{"(none)"}
	}
	fmt.Fprintf(w, "supported_actions: %s\n", strings.Join(supported, " "))
}
