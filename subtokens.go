package picomq

// Subscriptions: the callback tokens of webhook wakes and their ids.

import (
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"strings"
	"time"
)

// errTokenExpired is a token that was valid, and is past its expiry.
var errTokenExpired = errors.New("token expired")

type tokenClaims struct {
	Sub  string `json:"sub"` // subscription document key
	Gen  uint64 `json:"gen"`
	Wake string `json:"wake"`
	Exp  int64  `json:"exp"` // unix seconds
}

// tokenLocked is an HMAC-SHA256 signed token: base64url(claims) "." base64url(mac).
func (m *subManager) tokenLocked(s *subState) string {
	exp := time.Now().Add(s.lease() + time.Hour).Unix()
	b, _ := json.Marshal(tokenClaims{Sub: s.key, Gen: s.Generation, Wake: s.WakeID, Exp: exp})
	p := base64.RawURLEncoding.EncodeToString(b)
	h := hmac.New(sha256.New, m.mac)
	h.Write([]byte(p))
	return p + "." + base64.RawURLEncoding.EncodeToString(h.Sum(nil))
}

func (m *subManager) verifyTokenLocked(tok string) (tokenClaims, error) {
	var c tokenClaims
	p, sig, ok := strings.Cut(tok, ".")
	if !ok {
		return c, errors.New("malformed token")
	}
	got, err := base64.RawURLEncoding.DecodeString(sig)
	if err != nil {
		return c, err
	}
	h := hmac.New(sha256.New, m.mac)
	h.Write([]byte(p))
	if !hmac.Equal(got, h.Sum(nil)) {
		return c, errors.New("bad token signature")
	}
	b, err := base64.RawURLEncoding.DecodeString(p)
	if err != nil {
		return c, err
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return c, err
	}
	if time.Now().Unix() > c.Exp {
		return c, errTokenExpired
	}
	return c, nil
}

func newWakeID() string { return "w_" + hex.EncodeToString(randBytes(12)) }
