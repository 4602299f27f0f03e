package picomq

import (
	"sync"
	"time"

	"go.uber.org/zap"
)

// storeFailureLogEvery is the least time between two log lines of one kind
// of failed request (a write not confirmed, storage unavailable) on one
// storage.
const storeFailureLogEvery = 10 * time.Second

// sampledLog lets through one line of each message per interval and counts
// the ones it holds back, for the next line to report. While the store is
// out every request fails the same way, and a warning per request (each
// client retrying after its Retry-After second) buried the log in
// identical lines. One is shared by the handlers of a storage, whatever
// their protocol. A nil *sampledLog lets everything through.
type sampledLog struct {
	every time.Duration
	now   func() time.Time

	mu    sync.Mutex
	kinds map[string]*sampledKind
}

type sampledKind struct {
	last time.Time // when a line of this message was last logged
	held int       // lines held back since
}

func newSampledLog(every time.Duration) *sampledLog {
	return &sampledLog{every: every, now: time.Now, kinds: make(map[string]*sampledKind)}
}

// warn logs msg at warn level with fields, unless a line of msg was logged
// less than the interval ago; a line that follows held-back ones says how
// many in "similar_held_back".
func (s *sampledLog) warn(log *zap.Logger, msg string, fields ...zap.Field) {
	if s == nil {
		log.Warn(msg, fields...)
		return
	}
	s.mu.Lock()
	k := s.kinds[msg]
	if k == nil {
		k = &sampledKind{}
		s.kinds[msg] = k
	}
	now := s.now()
	if !k.last.IsZero() && now.Sub(k.last) < s.every {
		k.held++
		s.mu.Unlock()
		return
	}
	held := k.held
	k.last, k.held = now, 0
	s.mu.Unlock()
	if held > 0 {
		fields = append(fields, zap.Int("similar_held_back", held))
	}
	log.Warn(msg, fields...)
}
