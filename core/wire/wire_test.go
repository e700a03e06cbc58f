package wire

import (
	"encoding/json"
	"errors"
	"fmt"
	"reflect"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/ecmooncake/ecmooncake/core/ids"
)

var testToken = ids.Token{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}

func validPeers() PeersReply {
	return PeersReply{
		Shards: []ShardInfo{
			{Rank: 1, Control: "tcp://[::1]:5556", Data: map[string]string{"tcp": "[::1]:7001"}},
			{Rank: 0, Control: "tcp://10.0.0.1:5555", Data: map[string]string{"tcp": "10.0.0.1:7000", "mooncake": "10.0.0.1:12345"}, Epoch: "18c2f-9a0b1c2d"},
		},
		TPSize:     2,
		DPRank:     1,
		Host:       "node-a",
		SlabBytes:  1 << 30,
		Transports: []string{"tcp", "mooncake"},
	}
}

// bodies is one valid instance of every body type, by op and direction.
func bodies() []struct {
	name string
	op   Op
	req  any
	rep  any
} {
	return []struct {
		name string
		op   Op
		req  any
		rep  any
	}{
		{"peers", OpPeers, nil, validPeers()},
		{"event_port", OpEventPort, nil, EventPortReply{Endpoint: "tcp://node-a:40001", Epoch: "18c2f-9a0b1c2d"}},
		{"event_port_without_epoch", OpEventPort, nil, EventPortReply{Endpoint: "tcp://node-a:40001"}},
		{"reserve_batch", OpReserveBatch,
			ReserveBatch{Requester: testRequester, Items: []ReserveItem{{TransferID: "t1", MMHash: "h1", NBytes: 19 << 20}, {TransferID: "t2", MMHash: "h1", NBytes: 19 << 20}}},
			ReserveBatchReply{Grants: []Grant{
				{TransferID: "t1", Kind: KindWrite, Res: 7, Token: testToken, NBytes: 19 << 20},
				{TransferID: "t2", Kind: KindFollow, Res: 7, NBytes: 19 << 20},
				{TransferID: "t3", Kind: KindCached, NBytes: 5},
				{TransferID: "t4", Err: "slab full"},
			}, Epoch: "18c2f-9a0b1c2d", Host: "node-a", Data: map[string]string{"tcp": "10.0.0.1:7000"}}},
		{"reserve_batch_from_an_older_shard", OpReserveBatch,
			ReserveBatch{Requester: testRequester, Items: []ReserveItem{{TransferID: "t1", MMHash: "h1", NBytes: 1}}},
			ReserveBatchReply{Grants: []Grant{{TransferID: "t1", Kind: KindCached, NBytes: 1}}}},
		{"complete_batch", OpCompleteBatch,
			CompleteBatch{Items: []CompleteItem{{TransferID: "t1", Res: 7, Token: testToken}, {TransferID: "t2", Res: 8, Token: testToken, Abandon: true, Reason: "encoder failed"}}},
			CompleteBatchReply{Results: []ItemResult{{TransferID: "t1"}, {TransferID: "t2", Err: "unknown reservation"}}}},
		{"reserve_batch_with_credit", OpReserveBatch,
			ReserveBatch{Requester: testRequester, Items: []ReserveItem{{TransferID: "t1", MMHash: "h1", NBytes: 1}}, CreditBytes: 1 << 30},
			ReserveBatchReply{Grants: []Grant{{TransferID: "t1", Kind: KindCached, NBytes: 1}},
				Credit: &CreditGrant{Gen: 3, Token: testToken, LeaseMs: 30000, Base: 1 << 40, Extents: []CreditExtent{{Off: 0, Len: 1 << 20}, {Off: 4 << 20, Len: 256}}}}},
		{"claim_batch", OpClaimBatch,
			ClaimBatch{Requester: testRequester, Gen: 3, Token: testToken, CreditBytes: 1 << 30, Items: []ClaimItem{
				{TransferID: "t1", MMHash: "h1", NBytes: 19 << 20, Offset: 0, Meta: "bf16"}, {TransferID: "t2", MMHash: "h2", NBytes: 5, Offset: 19 << 20}}},
			ClaimBatchReply{Grants: []Grant{
				{TransferID: "t1", Kind: KindWrite, Res: 9, Token: testToken, NBytes: 19 << 20},
				{TransferID: "t2", Kind: KindCached, NBytes: 5},
				{TransferID: "t3", Err: "stale credit", Code: GrantCreditRefused},
			}, Credit: &CreditGrant{Gen: 3, Token: testToken, LeaseMs: 1, Extents: []CreditExtent{}}, Epoch: "18c2f-9a0b1c2d"}},
		{"claim_batch_window_gone", OpClaimBatch,
			ClaimBatch{Requester: testRequester, Gen: 1, Token: testToken, Items: []ClaimItem{{TransferID: "t1", MMHash: "h1", NBytes: 1}}},
			ClaimBatchReply{Grants: []Grant{{TransferID: "t1", Err: "no credit window", Code: GrantCreditRefused}}}},
		{"cancel", OpCancel, Cancel{TransferIDs: []string{"t1", "t2"}}, CancelReply{Cancelled: 2}},
		{"status", OpStatus, Status{TransferIDs: []string{"t1"}},
			StatusReply{Items: []ItemStatus{{TransferID: "t1", MMHash: "h1", State: "READY", NBytes: 5, Known: true, Done: true}, {TransferID: "t9"}}}},
		{"status_all", OpStatus, Status{}, StatusReply{Items: []ItemStatus{}, Epoch: "18c2f-9a0b1c2d"}},
	}
}

const testRequester = "00112233445566778899aabbccddeeff"

// decodeAs decodes raw into a fresh value of proto's type.
func decodeAs(t *testing.T, proto any, raw json.RawMessage) any {
	t.Helper()
	out := newOf(proto)
	require.NoError(t, UnmarshalBody(raw, out))
	return reflect.ValueOf(out).Elem().Interface()
}

func mustBody[T interface{ Validate() error }](t *testing.T, raw json.RawMessage) T {
	t.Helper()
	v, err := DecodeBody[T](raw)
	require.NoError(t, err)
	return v
}

func TestRoundTrip(t *testing.T) {
	for i, tc := range bodies() {
		t.Run(tc.name, func(t *testing.T) {
			id := uint64(i + 1)
			req, err := NewRequest(id, tc.op, tc.req)
			require.NoError(t, err)
			b, err := EncodeRequest(req)
			require.NoError(t, err)
			gotReq, err := DecodeRequest(b)
			require.NoError(t, err)
			require.Equal(t, req, gotReq)
			if tc.req == nil {
				require.Nil(t, gotReq.Body, "an op without body sends none")
			} else {
				require.Equal(t, tc.req, decodeAs(t, tc.req, gotReq.Body))
			}

			rep := OKReply(id, tc.rep)
			require.Nil(t, rep.Err)
			b, err = EncodeReply(rep)
			require.NoError(t, err)
			gotRep, err := DecodeReply(b)
			require.NoError(t, err)
			require.Equal(t, rep, gotRep)
			require.Equal(t, tc.rep, decodeAs(t, tc.rep, gotRep.Body))
		})
	}
}

func TestErrorReplyRoundTrip(t *testing.T) {
	for _, tc := range []struct {
		name string
		rep  Reply
	}{
		{"with id", ErrReply(9, CodeShuttingDown, "consumer closing")},
		{"id zero for an unreadable request", ErrReply(0, CodeBadRequest, "not json")},
		{"handler code", ErrReply(3, "slab_full", "")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, err := EncodeReply(tc.rep)
			require.NoError(t, err)
			got, err := DecodeReply(b)
			require.NoError(t, err)
			require.Equal(t, tc.rep, got)
		})
	}
}

func TestTokenOmittedWhenZero(t *testing.T) {
	b, err := json.Marshal(Grant{TransferID: "t", Kind: KindCached, NBytes: 1})
	require.NoError(t, err)
	require.NotContains(t, string(b), "token")
	b, err = json.Marshal(Grant{TransferID: "t", Kind: KindWrite, Res: 1, Token: testToken, NBytes: 1})
	require.NoError(t, err)
	require.Contains(t, string(b), `"token":"`+testToken.String()+`"`)
}

func TestDecodeRequestRejects(t *testing.T) {
	huge := `{"v":1,"id":77,"op":"status","body":{"transfer_ids":["` + strings.Repeat("x", MaxMessage) + `"]}}`
	for _, tc := range []struct {
		name   string
		in     string
		want   error
		code   string
		wantID uint64
		says   []string
	}{
		{"empty frame", ``, ErrMalformed, CodeBadRequest, 0, nil},
		{"garbage", "\x00\xffzz", ErrMalformed, CodeBadRequest, 0, nil},
		{"not an object", `[1,2]`, ErrMalformed, CodeBadRequest, 0, nil},
		{"truncated keeps id", `{"v":1,"id":12,"op":"cancel","body":{"transfer_`, ErrMalformed, CodeBadRequest, 12, nil},
		{"wrong type keeps id", `{"v":"one","id":13,"op":"cancel"}`, ErrMalformed, CodeBadRequest, 13, []string{"v"}},
		{"negative id", `{"v":1,"id":-1,"op":"peers"}`, ErrMalformed, CodeBadRequest, 0, nil},
		{"wrong version", `{"v":2,"id":14,"op":"peers"}`, ErrVersion, CodeVersion, 14, []string{"v2", "v1"}},
		{"missing version", `{"id":15,"op":"peers"}`, ErrVersion, CodeVersion, 15, []string{"v0", "v1"}},
		{"unknown op", `{"v":1,"id":16,"op":"reserve_all"}`, ErrUnknownOp, CodeUnknownOp, 16, []string{`"reserve_all"`}},
		{"missing op", `{"v":1,"id":17}`, ErrUnknownOp, CodeUnknownOp, 17, nil},
		{"zero id", `{"v":1,"id":0,"op":"peers"}`, ErrInvalid, CodeBadRequest, 0, []string{"id"}},
		{"missing id", `{"v":1,"op":"peers"}`, ErrInvalid, CodeBadRequest, 0, []string{"id"}},
		{"too large keeps id", huge, ErrTooLarge, CodeTooLarge, 77, []string{fmt.Sprint(MaxMessage)}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeRequest([]byte(tc.in))
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, tc.code, CodeOf(err))
			require.Equal(t, tc.wantID, got.ID, "recovered id")
			for _, s := range tc.says {
				require.Contains(t, err.Error(), s)
			}
		})
	}
}

func TestDecodeReplyRejects(t *testing.T) {
	for _, tc := range []struct {
		name   string
		in     string
		want   error
		wantID uint64
	}{
		{"garbage", `}{`, ErrMalformed, 0},
		{"wrong version", `{"v":3,"id":5,"body":{}}`, ErrVersion, 5},
		{"zero id without err", `{"v":1,"id":0,"body":{}}`, ErrInvalid, 0},
		{"err without code", `{"v":1,"id":6,"err":{"msg":"x"}}`, ErrInvalid, 6},
		{"err and body", `{"v":1,"id":7,"err":{"code":"internal"},"body":{}}`, ErrInvalid, 7},
		{"err of wrong type keeps id", `{"v":1,"id":8,"err":"boom"}`, ErrMalformed, 8},
		{"too large", strings.Repeat(" ", MaxMessage+1), ErrTooLarge, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := DecodeReply([]byte(tc.in))
			require.ErrorIs(t, err, tc.want)
			require.Equal(t, tc.wantID, got.ID)
		})
	}
}

func TestBodyRejects(t *testing.T) {
	long := strings.Repeat("t", MaxIDLen+1)
	many := make([]string, MaxItems+1)
	for i := range many {
		many[i] = fmt.Sprint(i)
	}
	peers := func(edit func(*PeersReply)) PeersReply {
		p := validPeers()
		p.Shards = append([]ShardInfo(nil), p.Shards...)
		edit(&p)
		return p
	}
	for _, tc := range []struct {
		name  string
		body  validator
		field string
	}{
		{"peers tp_size zero", peers(func(p *PeersReply) { p.TPSize = 0 }), "tp_size"},
		{"peers shard missing", peers(func(p *PeersReply) { p.TPSize = 3 }), "shards"},
		{"peers rank out of range", peers(func(p *PeersReply) { p.Shards[0].Rank = 2 }), "shards[0].rank"},
		{"peers rank twice", peers(func(p *PeersReply) { p.Shards[0].Rank = 0 }), "shards[1].rank"},
		{"peers no control", peers(func(p *PeersReply) { p.Shards[1].Control = "" }), "shards[1].control"},
		{"peers empty data address", peers(func(p *PeersReply) { p.Shards[0].Data = map[string]string{"tcp": ""} }), `shards[0].data["tcp"]`},
		{"peers negative dp_rank", peers(func(p *PeersReply) { p.DPRank = -1 }), "dp_rank"},
		{"peers no host", peers(func(p *PeersReply) { p.Host = "" }), "host"},
		{"peers no slab", peers(func(p *PeersReply) { p.SlabBytes = 0 }), "slab_bytes"},
		{"peers no transports", peers(func(p *PeersReply) { p.Transports = nil }), "transports"},
		{"peers empty transport", peers(func(p *PeersReply) { p.Transports = []string{"tcp", ""} }), "transports[1]"},
		{"peers long epoch", peers(func(p *PeersReply) { p.Shards[1].Epoch = long }), "shards[1].epoch"},
		{"event port empty", EventPortReply{}, "endpoint"},
		{"event port long epoch", EventPortReply{Endpoint: "tcp://a:1", Epoch: long}, "epoch"},
		{"grants long epoch", ReserveBatchReply{Epoch: long}, "epoch"},
		{"grants long host", ReserveBatchReply{Host: long}, "host"},
		{"grants empty data address", ReserveBatchReply{Data: map[string]string{"tcp": ""}}, `data["tcp"]`},
		{"grants empty data name", ReserveBatchReply{Data: map[string]string{"": "a:1"}}, "data key"},
		{"reserve empty", ReserveBatch{Requester: testRequester}, "items"},
		{"reserve too many", ReserveBatch{Requester: testRequester, Items: make([]ReserveItem, MaxItems+1)}, "items"},
		{"reserve no transfer id", ReserveBatch{Requester: testRequester, Items: []ReserveItem{{MMHash: "h", NBytes: 1}}}, "items[0].transfer_id"},
		{"reserve long transfer id", ReserveBatch{Requester: testRequester, Items: []ReserveItem{{TransferID: long, MMHash: "h", NBytes: 1}}}, "items[0].transfer_id"},
		{"reserve no mm hash", ReserveBatch{Requester: testRequester, Items: []ReserveItem{{TransferID: "t", MMHash: "h", NBytes: 1}, {TransferID: "t"}}}, "items[1].mm_hash"},
		{"reserve zero nbytes", ReserveBatch{Requester: testRequester, Items: []ReserveItem{{TransferID: "t", MMHash: "h"}}}, "items[0].nbytes"},
		{"reserve from an older producer", ReserveBatch{Items: []ReserveItem{{TransferID: "t", MMHash: "h", NBytes: 1}}}, "requester: missing"},
		{"reserve with a short requester", ReserveBatch{Requester: "abc", Items: []ReserveItem{{TransferID: "t", MMHash: "h", NBytes: 1}}}, "requester"},
		{"reserve with an upper-case requester", ReserveBatch{Requester: "0123456789ABCDEF0123456789ABCDEF", Items: []ReserveItem{{TransferID: "t", MMHash: "h", NBytes: 1}}}, "requester"},
		{"grant no transfer id", ReserveBatchReply{Grants: []Grant{{Kind: KindCached, NBytes: 1}}}, "grants[0].transfer_id"},
		{"grant unknown kind", ReserveBatchReply{Grants: []Grant{{TransferID: "t", Kind: "steal", NBytes: 1}}}, "grants[0].kind"},
		{"grant write without res", ReserveBatchReply{Grants: []Grant{{TransferID: "t", Kind: KindWrite, Token: testToken, NBytes: 1}}}, "grants[0].res"},
		{"grant write without token", ReserveBatchReply{Grants: []Grant{{TransferID: "t", Kind: KindWrite, Res: 1, NBytes: 1}}}, "grants[0].token"},
		{"grant zero nbytes", ReserveBatchReply{Grants: []Grant{{TransferID: "t", Kind: KindFollow, Res: 1}}}, "grants[0].nbytes"},
		{"claim without requester", ClaimBatch{Gen: 1, Token: testToken, Items: []ClaimItem{{TransferID: "t", MMHash: "h", NBytes: 1}}}, "requester"},
		{"claim without generation", ClaimBatch{Requester: testRequester, Token: testToken, Items: []ClaimItem{{TransferID: "t", MMHash: "h", NBytes: 1}}}, "gen"},
		{"claim without token", ClaimBatch{Requester: testRequester, Gen: 1, Items: []ClaimItem{{TransferID: "t", MMHash: "h", NBytes: 1}}}, "token"},
		{"claim empty", ClaimBatch{Requester: testRequester, Gen: 1, Token: testToken}, "items"},
		{"claim zero nbytes", ClaimBatch{Requester: testRequester, Gen: 1, Token: testToken, Items: []ClaimItem{{TransferID: "t", MMHash: "h"}}}, "items[0].nbytes"},
		{"claim no mm hash", ClaimBatch{Requester: testRequester, Gen: 1, Token: testToken, Items: []ClaimItem{{TransferID: "t", NBytes: 1}}}, "items[0].mm_hash"},
		{"claim long meta", ClaimBatch{Requester: testRequester, Gen: 1, Token: testToken, Items: []ClaimItem{{TransferID: "t", MMHash: "h", NBytes: 1, Meta: strings.Repeat("m", MaxMetaLen+1)}}}, "items[0].meta"},
		{"claim grant write without token", ClaimBatchReply{Grants: []Grant{{TransferID: "t", Kind: KindWrite, Res: 1, NBytes: 1}}}, "grants[0].token"},
		{"credit without generation", ClaimBatchReply{Credit: &CreditGrant{Token: testToken}}, "credit.gen"},
		{"credit without token", ReserveBatchReply{Credit: &CreditGrant{Gen: 1}}, "credit.token"},
		{"credit empty extent", ReserveBatchReply{Credit: &CreditGrant{Gen: 1, Token: testToken, Extents: []CreditExtent{{Off: 1}}}}, "credit.extents[0]"},
		{"credit extent wraps", ReserveBatchReply{Credit: &CreditGrant{Gen: 1, Token: testToken, Extents: []CreditExtent{{Off: 1 << 63, Len: 1 << 63}}}}, "credit.extents[0]"},
		{"credit extent wraps past base", ClaimBatchReply{Credit: &CreditGrant{Gen: 1, Token: testToken, Base: 1 << 63, Extents: []CreditExtent{{Off: 1 << 62, Len: 1 << 62}}}}, "credit.extents[0]"},
		{"credit too many extents", ClaimBatchReply{Credit: &CreditGrant{Gen: 1, Token: testToken, Extents: make([]CreditExtent, MaxCreditExtents+1)}}, "credit.extents"},
		{"complete empty", CompleteBatch{}, "items"},
		{"complete no transfer id", CompleteBatch{Items: []CompleteItem{{Res: 1}}}, "items[0].transfer_id"},
		{"complete result no transfer id", CompleteBatchReply{Results: []ItemResult{{Err: "x"}}}, "results[0].transfer_id"},
		{"cancel empty", Cancel{}, "transfer_ids"},
		{"cancel too many", Cancel{TransferIDs: many}, "transfer_ids"},
		{"cancel empty id", Cancel{TransferIDs: []string{"a", ""}}, "transfer_ids[1]"},
		{"cancel reply negative", CancelReply{Cancelled: -1}, "cancelled"},
		{"status too many", Status{TransferIDs: many}, "transfer_ids"},
		{"status long id", Status{TransferIDs: []string{long}}, "transfer_ids[0]"},
		{"status item no id", StatusReply{Items: []ItemStatus{{}}}, "items[0].transfer_id"},
		{"status long epoch", StatusReply{Epoch: long}, "epoch"},
		{"status known without hash", StatusReply{Items: []ItemStatus{{TransferID: "t", Known: true, State: "READY"}}}, "items[0].mm_hash"},
		{"status known without state", StatusReply{Items: []ItemStatus{{TransferID: "t", MMHash: "h", Known: true}}}, "items[0].state"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.body.Validate()
			require.ErrorIs(t, err, ErrInvalid)
			require.ErrorIs(t, err, ErrBadRequest)
			require.Contains(t, err.Error(), tc.field)

			// The decoder refuses the same body, naming the same field.
			raw, merr := json.Marshal(tc.body)
			require.NoError(t, merr)
			derr := UnmarshalBody(raw, newOf(tc.body))
			require.ErrorIs(t, derr, ErrInvalid)
			require.Contains(t, derr.Error(), tc.field)

			_, rerr := NewRequest(1, OpCancel, tc.body)
			require.ErrorIs(t, rerr, ErrInvalid, "a request is validated at its author")
		})
	}
}

// newOf returns a pointer to a zero value of v's type.
func newOf(v any) any { return reflect.New(reflect.TypeOf(v)).Interface() }

func TestDecodeBody(t *testing.T) {
	t.Run("unknown fields ignored", func(t *testing.T) {
		got, err := DecodeBody[ReserveBatch](json.RawMessage(`{"requester":"` + testRequester + `","items":[{"transfer_id":"t","mm_hash":"h","nbytes":3,"priority":9}],"hint":{"x":[1]}}`))
		require.NoError(t, err)
		require.Equal(t, ReserveBatch{Requester: testRequester, Items: []ReserveItem{{TransferID: "t", MMHash: "h", NBytes: 3}}}, got)
	})
	for _, tc := range []struct {
		name  string
		raw   string
		want  error
		field string
	}{
		{"missing body", ``, ErrMalformed, "missing body"},
		{"null body", `null`, ErrInvalid, "items"},
		{"not json", `{"items":`, ErrMalformed, "ReserveBatch"},
		{"wrong field type", `{"items":[{"transfer_id":"t","mm_hash":"h","nbytes":"3"}]}`, ErrMalformed, "nbytes"},
		{"negative size", `{"items":[{"transfer_id":"t","mm_hash":"h","nbytes":-3}]}`, ErrMalformed, "nbytes"},
		{"missing size", `{"items":[{"transfer_id":"t","mm_hash":"h"}]}`, ErrInvalid, "items[0].nbytes"},
		{"bad token", `{"items":[{"transfer_id":"t","token":"abc"}]}`, ErrMalformed, "token"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var err error
			if tc.name == "bad token" {
				_, err = DecodeBody[CompleteBatch](json.RawMessage(tc.raw))
			} else {
				_, err = DecodeBody[ReserveBatch](json.RawMessage(tc.raw))
			}
			require.ErrorIs(t, err, tc.want)
			require.Contains(t, err.Error(), tc.field)
		})
	}
}

func TestNewRequestRejects(t *testing.T) {
	for _, tc := range []struct {
		name string
		id   uint64
		op   Op
		body any
		want error
	}{
		{"zero id", 0, OpPeers, nil, ErrInvalid},
		{"unknown op", 1, Op("drop_all"), nil, ErrUnknownOp},
		{"invalid body", 1, OpReserveBatch, ReserveBatch{}, ErrInvalid},
		{"unmarshallable body", 1, OpStatus, map[string]any{"f": func() {}}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewRequest(tc.id, tc.op, tc.body)
			require.Error(t, err)
			if tc.want != nil {
				require.ErrorIs(t, err, tc.want)
			}
		})
	}
	req, err := NewRequest(1, OpStatus, (*Status)(nil))
	require.NoError(t, err)
	require.Nil(t, req.Body, "a typed nil body is no body")
}

func TestEncodeRejects(t *testing.T) {
	_, err := EncodeRequest(Request{V: Version, ID: 1, Op: "nope"})
	require.ErrorIs(t, err, ErrUnknownOp)
	_, err = EncodeRequest(Request{ID: 1, Op: OpPeers})
	require.ErrorIs(t, err, ErrVersion)
	_, err = EncodeReply(Reply{V: Version})
	require.ErrorIs(t, err, ErrInvalid)

	big, err := json.Marshal(strings.Repeat("x", MaxMessage))
	require.NoError(t, err)
	_, err = EncodeRequest(Request{V: Version, ID: 1, Op: OpStatus, Body: big})
	require.ErrorIs(t, err, ErrTooLarge)
}

func TestOKReplyOfUnmarshallableBody(t *testing.T) {
	rep := OKReply(4, func() {})
	require.NotNil(t, rep.Err)
	require.Equal(t, CodeInternal, rep.Err.Code)
	require.Equal(t, uint64(4), rep.ID)
}

func TestCodeOf(t *testing.T) {
	for _, tc := range []struct {
		err  error
		code string
	}{
		{nil, ""},
		{ErrMalformed, CodeBadRequest},
		{fmt.Errorf("ctx: %w", ErrInvalid), CodeBadRequest},
		{ErrVersion, CodeVersion},
		{ErrUnknownOp, CodeUnknownOp},
		{ErrTooLarge, CodeTooLarge},
		{ErrShuttingDown, CodeShuttingDown},
		{errors.New("disk on fire"), CodeInternal},
		{fmt.Errorf("call: %w", &Error{Code: "slab_full"}), "slab_full"},
	} {
		require.Equal(t, tc.code, CodeOf(tc.err), "%v", tc.err)
	}
}

func TestErrorMatchesSentinelOfItsCode(t *testing.T) {
	for code, sentinel := range codeSentinel {
		err := fmt.Errorf("call: %w", &Error{Code: code, Msg: "m"})
		require.ErrorIs(t, err, sentinel, code)
		for other, s := range codeSentinel {
			if other != code {
				require.NotErrorIs(t, err, s, "%s is not %s", code, other)
			}
		}
	}
	require.NotErrorIs(t, &Error{Code: "slab_full"}, ErrInternal)
	require.Equal(t, "version: v2 vs v1", (&Error{Code: CodeVersion, Msg: "v2 vs v1"}).Error())
}

func TestOpKnown(t *testing.T) {
	for _, tc := range []struct {
		op   Op
		want bool
	}{
		{OpPeers, true}, {OpEventPort, true}, {OpReserveBatch, true}, {OpCompleteBatch, true},
		{OpCancel, true}, {OpStatus, true}, {OpClaimBatch, true}, {"", false}, {"PEERS", false}, {"reserve", false},
	} {
		require.Equal(t, tc.want, tc.op.Known(), "%q", tc.op)
	}
}

func TestBodyCanonicalised(t *testing.T) {
	req, err := DecodeRequest([]byte(`{"v":1,"id":3,"op":"cancel","body": { "transfer_ids" : [ "a" ] } }`))
	require.NoError(t, err)
	require.Equal(t, `{"transfer_ids":["a"]}`, string(req.Body))
	req, err = DecodeRequest([]byte(`{"v":1,"id":3,"op":"peers","body":null}`))
	require.NoError(t, err)
	require.Nil(t, req.Body)
}

// TestEmptyOptionalCollectionsDecodeAsAbsent: an empty optional collection
// decodes as if absent, so that the body equals the decoding of its own
// re-encoding (found by FuzzDecodeReserveBatchReply).
func TestEmptyOptionalCollectionsDecodeAsAbsent(t *testing.T) {
	roundTrips := func(t *testing.T, v any, decode func([]byte) any) {
		t.Helper()
		again, err := marshal(v)
		require.NoError(t, err)
		require.Equal(t, v, decode(again))
	}
	t.Run("reserve_batch_reply data", func(t *testing.T) {
		r := mustBody[ReserveBatchReply](t, []byte(`{"grants":[],"data":{}}`))
		require.Nil(t, r.Data)
		roundTrips(t, r, func(b []byte) any { return mustBody[ReserveBatchReply](t, b) })
	})
	t.Run("status transfer_ids", func(t *testing.T) {
		s := mustBody[Status](t, []byte(`{"transfer_ids":[]}`))
		require.Nil(t, s.TransferIDs, "an empty list asks for every item, as no list does")
		roundTrips(t, s, func(b []byte) any { return mustBody[Status](t, b) })
	})
	t.Run("peers shard data", func(t *testing.T) {
		got := mustBody[PeersReply](t, []byte(`{"shards":[{"rank":0,"control":"tcp://10.0.0.1:5555","data":{}}],`+
			`"tp_size":1,"dp_rank":0,"host":"node-a","slab_bytes":1,"transports":["tcp"]}`))
		require.Nil(t, got.Shards[0].Data)
		roundTrips(t, got, func(b []byte) any { return mustBody[PeersReply](t, b) })
	})
}
