package picomq

import (
	"context"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
)

// TestWebhookPostErrorHidesTheURL: the error of a delivery that could not
// be made, which the manager logs, names the webhook's scheme and host and
// the reason, never the URL's path or query, where receivers keep their
// secret (?token=..., /services/T.../B.../XXXX). The Go client's own error
// quotes the whole URL.
func TestWebhookPostErrorHidesTheURL(t *testing.T) {
	gone := httptest.NewServer(http.NotFoundHandler())
	gone.Close() // connections to it are refused
	host := strings.TrimPrefix(gone.URL, "http://")
	m := &subManager{ctx: context.Background(), client: &http.Client{}}
	for _, tc := range []struct {
		name, target string
		secrets      []string
		want         []string
	}{
		{"query", gone.URL + "/hook?token=q-secret", []string{"q-secret", "token", "/hook"}, []string{"http://" + host, "connection refused"}},
		{"path", gone.URL + "/services/T0SECRET/B0SECRET", []string{"T0SECRET", "B0SECRET", "/services"}, []string{"http://" + host, "connection refused"}},
		{"user info", "http://user:p-secret@" + host + "/h", []string{"p-secret", "user"}, []string{"http://" + host, "connection refused"}},
		{"unparsable", "http://" + host + "/h?x=%zz\x7f-secret", []string{"-secret"}, []string{"webhook URL"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := m.post(tc.target, true, "sig", []byte("{}"))
			if err == nil {
				t.Fatal("a delivery to a closed port succeeded")
			}
			for _, s := range tc.secrets {
				if strings.Contains(err.Error(), s) {
					t.Errorf("the error shows %q of the webhook URL: %v", s, err)
				}
			}
			for _, s := range tc.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("the error does not say %q: %v", s, err)
				}
			}
		})
	}
}
