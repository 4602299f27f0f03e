package picomq

// Subscriptions: reading control bodies and writing their answers.

import (
	"bytes"
	"encoding/json"
	"errors"
	"net/http"
	"strings"

	"go.uber.org/zap"

	"github.com/picomq/caddy-picomq/streamstore"
)

func readJSONBody(w http.ResponseWriter, r *http.Request, v any) bool {
	data, ok := readControlBody(w, r)
	if !ok {
		return false
	}
	if err := json.Unmarshal(data, v); err != nil {
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", "invalid JSON: "+err.Error())
		return false
	}
	return true
}

// readControlBody reads a control request's body ("{}" when empty),
// answering and reporting false when it cannot be read.
func readControlBody(w http.ResponseWriter, r *http.Request) ([]byte, bool) {
	data, err := readBody(r, subMaxBody, limitSubscription)
	switch {
	case errors.Is(err, errBodyTooLarge):
		subError(w, http.StatusRequestEntityTooLarge, "PAYLOAD_TOO_LARGE", err.Error())
		return nil, false
	case errors.Is(err, errBodyEncoded):
		w.Header().Set("Accept-Encoding", "identity")
		subError(w, http.StatusUnsupportedMediaType, "INVALID_REQUEST", err.Error())
		return nil, false
	case errors.Is(err, errBodyTimeout):
		subError(w, http.StatusRequestTimeout, "INVALID_REQUEST", err.Error())
		return nil, false
	case err != nil:
		subError(w, http.StatusBadRequest, "INVALID_REQUEST", "unreadable body: "+err.Error())
		return nil, false
	}
	if len(bytes.TrimSpace(data)) == 0 {
		data = []byte("{}")
	}
	return data, true
}

// heldResponse keeps a handler's status and body in memory until send;
// its headers are the response's own.
type heldResponse struct {
	w      http.ResponseWriter
	status int
	body   bytes.Buffer
}

func (h *heldResponse) Header() http.Header { return h.w.Header() }

func (h *heldResponse) WriteHeader(status int) {
	if h.status == 0 {
		h.status = status
	}
}

func (h *heldResponse) Write(b []byte) (int, error) {
	h.WriteHeader(http.StatusOK)
	return h.body.Write(b)
}

// send writes what was kept to the client; nothing when nothing was
// written (net/http then answers 200 itself, as it would have).
func (h *heldResponse) send() {
	if h.status == 0 {
		return
	}
	h.w.WriteHeader(h.status)
	if h.body.Len() > 0 {
		h.w.Write(h.body.Bytes())
	}
}

func writeJSONStatus(w http.ResponseWriter, status int, ctype string, v any) {
	b, _ := json.Marshal(v)
	w.Header().Set("Content-Type", ctype)
	if w.Header().Get("Cache-Control") == "" {
		w.Header().Set("Cache-Control", cacheControlNoStore)
	}
	w.WriteHeader(status)
	w.Write(b)
}

// subWrite is the change a subscription request writes to its document,
// for the answer to a write that storage did not confirm, which may still
// have landed: what the change is called, and what a repeat of the request
// does, which makes the repeat safe. The zero subWrite is a request that
// failed before writing anything of its own.
type subWrite struct {
	what   string
	repeat string
	// outcome, when set, says what became of the change instead of
	// subMaybeTaken (a delete: the server finishes it).
	outcome string
}

// subMaybeTaken is what became of a change storage did not confirm.
const subMaybeTaken = "it was not acknowledged, and it may or may not take effect"

// The changes of the subscription requests. Each repeat is what
// TestUnconfirmedSubscriptionWritesAreRepeated and, where the change took
// effect, ...AfterARestart check (a callback is an ack's handler). While
// this server keeps the storage, a change whose write was not confirmed is
// not its state (commitLocked), so a repeat does it again; a server that
// reads the document anew (another that takes the storage over, a restart)
// finds it if it landed, and a repeat then meets it done. A delete is the
// exception, and so is a create: this server takes the subscription out
// of service and finishes the delete itself (handleDelete), and undoes
// the create the same way (handlePut).
var (
	subWriteCreate = subWrite{what: "create",
		repeat: "repeat it: an identical PUT creates the subscription once storage has confirmed the undo (it waits for that a few seconds)",
		outcome: "it was not acknowledged, and the server undoes it until storage confirms that: " +
			"the subscription does not exist on this server"}
	subWriteDelete = subWrite{what: "delete",
		repeat: "repeat it: a repeat answers 204 once storage has confirmed the delete (it waits for that a few seconds)",
		outcome: "it was not acknowledged, and the server goes on deleting it until storage confirms it: " +
			"the subscription is gone from this server, which wakes no worker and calls no webhook for it"}
	subWriteAdd = subWrite{what: "change of the subscription's streams",
		repeat: "repeat it: it links each stream once, and leaves a stream linked already at its offsets"}
	subWriteRemove = subWrite{what: "change of the subscription's streams",
		repeat: "repeat it: a removal of a stream the subscription does not link succeeds"}
	subWriteClaim = subWrite{what: "claim",
		repeat: "repeat it with the same worker: it is granted, or, where the claim took effect, answered " +
			"409 ALREADY_CLAIMED naming this worker until that lease runs out"}
	subWriteAck = subWrite{what: "ack",
		repeat: ackRepeat}
	subWriteCallback = subWrite{what: "callback",
		repeat: ackRepeat}
	subWriteAckDone = subWrite{what: "ack",
		repeat: ackDoneRepeat}
	subWriteCallbackDone = subWrite{what: "callback",
		repeat: ackDoneRepeat}
	subWriteRelease = subWrite{what: "release",
		repeat: "repeat it: it is taken, or, where it took effect and ended the wake, answered 409 FENCED"}
)

// What a repeat of an ack (or a webhook's callback) does, one that ends
// the wake (done) or not.
const (
	ackRepeat     = "repeat it as it was: an ack at the offsets it acknowledged is taken again"
	ackDoneRepeat = "repeat it as it was: it is taken, or, where it took effect and ended the wake, answered 409 FENCED"
)

// ackWrite is the change of an ack, or of a webhook's callback, that ends
// the wake or not (done).
func ackWrite(callback, done bool) subWrite {
	switch {
	case callback && done:
		return subWriteCallbackDone
	case callback:
		return subWriteCallback
	case done:
		return subWriteAckDone
	}
	return subWriteAck
}

// subUnavailableMessage answers a subscription request that failed on
// storage without writing anything.
const subUnavailableMessage = "storage unavailable; nothing was changed, retry"

// storeFailed answers 503 UNAVAILABLE with Retry-After to a subscription
// request that failed on storage, op being the change it writes, as a
// stream's write is answered in the same case: a write storage did not
// confirm may or may not take effect, and the answer says what a repeat
// does (op); a refusal of the storage's for good is named, and so is
// another server's takeover; anything else changed nothing. No answer
// names an object key or the store's error, which the warning logged
// (sampled with the storage's stream failures) has.
func (m *subManager) storeFailed(w http.ResponseWriter, r *http.Request, op subWrite, err error) {
	reason, refused := streamstore.StorageRefusal(err)
	var warning, msg string
	switch {
	case op.what != "" && errors.Is(err, streamstore.ErrUnconfirmed):
		warning = failWarning("write not confirmed in time", err)
		outcome := op.outcome
		if outcome == "" {
			outcome = subMaybeTaken
		}
		if refused {
			msg = "storage refuses writes: " + reason + "; the " + op.what + " " +
				strings.TrimPrefix(outcome, "it ") + "; once storage takes writes again, " + op.repeat
		} else {
			msg = "storage did not confirm the " + op.what + ": " + outcome + "; " + op.repeat
		}
	case errors.Is(err, streamstore.ErrTakenOver):
		warning, msg = "storage taken over by another server", takenOverMessage
	case refused:
		warning, msg = failWarning("storage unavailable", err),
			"storage refuses writes: "+reason+"; nothing was written, retry once storage takes writes again"
	default:
		warning, msg = failWarning("storage unavailable", err), subUnavailableMessage
	}
	m.owner.storeFailLog().warn(m.log, warning, zap.String("method", r.Method), zap.String("subscription", r.URL.Path), zap.Error(err))
	w.Header().Set("Retry-After", "1")
	subError(w, http.StatusServiceUnavailable, "UNAVAILABLE", msg)
}

func subError(w http.ResponseWriter, status int, code, msg string) {
	writeJSONStatus(w, status, "application/json", map[string]any{"error": map[string]string{"code": code, "message": msg}})
}
