package main

// An in-process gRPC round trip over bufconn. Besides testing the example, it
// proves the generated package works with the installed protobuf runtime at
// run time: with Debian's golang-github-golang-protobuf-1-3-dev (instead of
// -1-5-dev) everything compiles but grpc's codec panics on decode.

import (
	"bytes"
	"context"
	"net"
	"testing"
	"time"

	kvhintv1 "github.com/kvhint/kvhint/gen/go/kvhint/v1"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/grpc/test/bufconn"
	"google.golang.org/protobuf/types/known/durationpb"
)

type fakeEngine struct {
	kvhintv1.UnimplementedKvHintServiceServer
}

func (fakeEngine) GetCapabilities(context.Context, *kvhintv1.GetCapabilitiesRequest) (*kvhintv1.GetCapabilitiesResponse, error) {
	return &kvhintv1.GetCapabilitiesResponse{
		ProtocolVersion: "kvhint.v1",
		Engine:          "fake",
		EngineVersion:   "0",
		BlockSize:       16,
		Actions: []*kvhintv1.ActionSupport{
			{Action: kvhintv1.Action_ACTION_RETAIN, Supported: true,
				Selectors: []kvhintv1.SelectorKind{kvhintv1.SelectorKind_SELECTOR_KIND_SESSION, kvhintv1.SelectorKind_SELECTOR_KIND_BLOCK_HASHES}},
			{Action: kvhintv1.Action_ACTION_DEMOTE, Supported: false},
			{Action: kvhintv1.Action_ACTION_EVICT, Supported: true,
				Selectors: []kvhintv1.SelectorKind{kvhintv1.SelectorKind_SELECTOR_KIND_CONTINUATION}},
		},
		Limits: &kvhintv1.Limits{MaxTtl: durationpb.New(time.Hour)},
	}, nil
}

func serve(t *testing.T, srv kvhintv1.KvHintServiceServer) grpc.DialOption {
	t.Helper()
	lis := bufconn.Listen(1 << 20)
	s := grpc.NewServer()
	kvhintv1.RegisterKvHintServiceServer(s, srv)
	go s.Serve(lis)
	t.Cleanup(s.Stop)
	return grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return lis.Dial() })
}

func TestGetCapabilities(t *testing.T) {
	dialer := serve(t, fakeEngine{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := getCapabilities(ctx, "bufnet", dialer)
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetLimits().GetMaxTtl().AsDuration(); got != time.Hour {
		t.Errorf("limits.max_ttl = %v, want 1h", got)
	}
	var out bytes.Buffer
	describe(&out, resp)
	want := "protocol_version: kvhint.v1\n" +
		"engine: fake 0\n" +
		"block_size: 16\n" +
		"supported_actions: RETAIN[SESSION,BLOCK_HASHES] EVICT[CONTINUATION]\n"
	if out.String() != want {
		t.Errorf("describe:\n%s\nwant:\n%s", out.String(), want)
	}
}

func TestGetCapabilitiesError(t *testing.T) {
	dialer := serve(t, kvhintv1.UnimplementedKvHintServiceServer{})
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_, err := getCapabilities(ctx, "bufnet", dialer)
	if status.Code(errorsUnwrap(err)) != codes.Unimplemented {
		t.Fatalf("err = %v, want UNIMPLEMENTED", err)
	}
}

// errorsUnwrap returns the innermost wrapped error (status.Code in grpc 1.33
// does not unwrap).
func errorsUnwrap(err error) error {
	for {
		u, ok := err.(interface{ Unwrap() error })
		if !ok {
			return err
		}
		err = u.Unwrap()
	}
}
